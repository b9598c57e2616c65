package limiter

import (
	"context"
	"fmt"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// The lean script (redis_fixed.lua) against the general one (redis.lua) with
// one fixed-window check that does not ban, on a real Redis: from the same
// keys (none, a count in or over its window, one without an expiry, a GCRA
// arrival time, a refused tally, a damaged count or tally), with every cutoff
// and cost, both return the same results and leave the same keys behind, in
// every combination.
func TestRedisFixedScriptMatchesGeneral(t *testing.T) {
	t.Parallel()
	client := realClient(t, "the scripts' equivalence needs a real Redis")
	ctx := context.Background()
	// within reports whether two times to live, read a moment apart, agree.
	within := func(a, b int64) bool { return a == b || (a > 0 && b > 0 && a-b < 200 && b-a < 200) }
	maxes, windows := []int{1, 2, 5}, []int64{1000, 5000}
	cutoffs := []int64{-1, 0, 500, 3000, 10_000}
	// Damaged: no integer to Redis (a word, a fraction, a leading zero, out
	// of int64's range), or a key of another type.
	counts := []string{"", "0", "1", "4", "5", "6", "3000000000", "many", "1.5", "05", "99999999999999999999", hashKey}
	ttls := []int64{0, 300, 2000, 8000} // 0: no expiry
	refuseds := []string{"", "1", "7", "many", hashKey}
	// Every combination of them, with costs 1 to 3.
	cases := len(maxes) * len(windows) * len(cutoffs) * len(counts) * len(ttls) * len(refuseds) * 3
	for i := range cases {
		rest := i
		pick := func(n int) int { k := rest % n; rest /= n; return k }
		max, window := maxes[pick(len(maxes))], windows[pick(len(windows))]
		cutoff := cutoffs[pick(len(cutoffs))]
		count, ttl := counts[pick(len(counts))], ttls[pick(len(ttls))]
		refused := refuseds[pick(len(refuseds))]
		cost := 1 + pick(3)
		var res [2][]int64
		var state [2][2]int64
		var values [2][2]string
		for side, script := range []*redis.Script{hitScript, fixedScript} {
			base := fmt.Sprintf("{t%d-%d}:", i, side)
			c, rk := base+"c", base+"r"
			if count != "" {
				setValue(ctx, t, client, c, count)
				if ttl > 0 {
					client.PExpire(ctx, c, time.Duration(ttl)*time.Millisecond)
				}
			}
			if refused != "" {
				setValue(ctx, t, client, rk, refused)
				client.PExpire(ctx, rk, time.Duration(window)*time.Millisecond)
			}
			keys := []string{c, rk}
			args := []any{max, window, cutoff, cost}
			if script == hitScript {
				keys = append(keys, base+"p")
				args = []any{max, window, cutoff, 0, cost, 0, "", ""}
			}
			var err error
			res[side], err = script.Run(ctx, client, keys, args...).Int64Slice()
			if err != nil {
				t.Fatalf("case %d, side %d: %v", i, side, err)
			}
			pttl := func(k string) int64 { v, _ := client.Do(ctx, "PTTL", k).Int64(); return v }
			state[side] = [2]int64{pttl(c), pttl(rk)}
			values[side] = [2]string{valueOf(ctx, client, c), valueOf(ctx, client, rk)}
		}
		a, b := res[0], res[1]
		same := len(a) == 8 && len(b) == 8 && within(a[2], b[2])
		for j := range min(len(a), len(b)) {
			same = same && (j == 2 || a[j] == b[j])
		}
		same = same && values[0] == values[1] && within(state[0][0], state[1][0]) && within(state[0][1], state[1][1])
		if !same {
			t.Fatalf("case %d (max %d, window %d, cutoff %d, cost %d, count %q ttl %d, refused %q):\n general %v, keys %q, ttls %v\n fixed   %v, keys %q, ttls %v",
				i, max, window, cutoff, cost, count, ttl, refused, a, values[0], state[0], b, values[1], state[1])
		}
	}
}

// realClient starts a redis-server of the test's own (why: what needs it
// real) and returns a client of it, closed when the test ends.
func realClient(t *testing.T, why string) *redis.Client {
	srv := redistest.StartReal(t, why)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { client.Close() })
	return client
}

// hashKey, as a value for setValue, makes the key a hash.
const hashKey = "<hash>"

// setValue sets key to value, or to a hash for hashKey, with no expiry.
func setValue(ctx context.Context, t *testing.T, client redis.UniversalClient, key, value string) {
	t.Helper()
	err := client.Del(ctx, key).Err()
	if err == nil && value == hashKey {
		err = client.HSet(ctx, key, "f", "1").Err()
	} else if err == nil {
		err = client.Set(ctx, key, value, 0).Err()
	}
	if err != nil {
		t.Fatal(err)
	}
}

// Out of memory (noeviction), both scripts fail a decision on a count
// that admits, one that refuses and a new key alike with Redis's OOM error,
// and write nothing: their first write is one Redis refuses then.
func TestRedisScriptsOutOfMemory(t *testing.T) {
	t.Parallel()
	client := realClient(t, "maxmemory")
	ctx := context.Background()
	states := [][2]string{{"", ""}, {"1", ""}, {"1", "3"}, {"5", ""}, {"5", "3"}} // count, refused (max 5)
	type key struct{ c, r string }
	var keys []key
	for i, st := range states {
		for side := range 2 {
			base := fmt.Sprintf("{oom%d-%d}:", i, side)
			k := key{base + "c", base + "r"}
			for j, v := range st {
				if v != "" {
					client.Set(ctx, []string{k.c, k.r}[j], v, time.Minute)
				}
			}
			keys = append(keys, k)
		}
	}
	for _, kv := range [][2]string{{"maxmemory-policy", "noeviction"}, {"maxmemory", "1"}} {
		if err := client.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	defer client.ConfigSet(ctx, "maxmemory", "0")
	for i, k := range keys {
		var err error
		if i%2 == 0 {
			err = hitScript.Run(ctx, client, []string{k.c, k.r, k.c + "p"}, 5, 60_000, 60_000, 0, 1, 0, "", "").Err()
		} else {
			err = fixedScript.Run(ctx, client, []string{k.c, k.r}, 5, 60_000, 60_000, 1).Err()
		}
		if err == nil || !strings.Contains(err.Error(), "OOM") {
			t.Errorf("%s, %s script, out of memory: %v; want Redis's OOM error", k.c, []string{"general", "lean"}[i%2], err)
		}
		st := states[i/2]
		if c, r := valueOf(ctx, client, k.c), valueOf(ctx, client, k.r); c != st[0] || r != st[1] {
			t.Errorf("%s, out of memory: keys hold %q, %q; want %q, %q as before", k.c, c, r, st[0], st[1])
		}
	}
}

// valueOf returns key's value: "" when there is no key, hashKey for a hash.
func valueOf(ctx context.Context, client redis.UniversalClient, key string) string {
	v, err := client.Get(ctx, key).Result()
	switch {
	case err == redis.Nil:
		return ""
	case err != nil && strings.HasPrefix(err.Error(), "WRONGTYPE"):
		return hashKey
	case err != nil:
		return "<" + err.Error() + ">"
	}
	return v
}

// A key under the store's prefix that holds no integer was not written by
// the scripts: a hand-made SET, another program's key, a value out of
// range. On every script's path the decision on it starts the limit afresh
// instead of failing, which would refuse (or wave through, as on_error
// says) that client on every request and, three failures on, degrade the
// whole store.
func TestRedisDamagedKeysStartAfresh(t *testing.T) {
	t.Parallel()
	srv := redistest.StartReal(t, "damaged keys")
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{OnError: OnErrorDeny})
	ctx := context.Background()
	limits := map[string]Limit{
		"fixed":   {Window: time.Minute, Max: 3},
		"banning": {Window: time.Minute, Max: 3, Ban: time.Minute},
		"sliding": {Window: time.Minute, Max: 3, Algorithm: SlidingWindow},
		"gcra":    {Window: time.Minute, Max: 3, Algorithm: GCRA, Burst: 3},
	}
	damages := []string{"many", "1.5", "05", "-", "99999999999999999999", hashKey}
	for name, lim := range limits {
		for _, suffix := range []string{"c", "p", "r", "s"} {
			for j, damage := range damages {
				key := fmt.Sprintf("%s-%s-%d", name, suffix, j)
				base := s.base("", key)
				// The refused and strikes keys are read only when the
				// limit refuses: fill the window first.
				fill := suffix == "r" || suffix == "s"
				if fill {
					for range lim.Max {
						if v, err := s.Hit(ctx, key, time.Now(), lim); err != nil || !v.Allowed {
							t.Fatalf("%s: filling: %+v, %v", key, v, err)
						}
					}
				}
				setValue(ctx, t, client, base+suffix, damage)
				v, err := s.Hit(ctx, key, time.Now(), lim)
				if err != nil || v.StoreError {
					t.Fatalf("%s, %s key %q: %+v, %v; want a decision", key, suffix, damage, v, err)
				}
				if fill == v.Allowed || (!fill && v.Remaining != lim.Max-1) {
					t.Fatalf("%s, %s key %q: %+v; want %s", key, suffix, damage, v,
						map[bool]string{true: "refused", false: "admitted, the limit afresh"}[fill])
				}
			}
		}
	}
	if h := s.Health(); h != HealthHealthy {
		t.Fatalf("health %s after decisions on damaged keys, want HEALTHY", h)
	}

	// The listing skips a damaged count and reads a damaged tally or
	// previous count as 0, instead of failing; each key alone under its
	// prefix, since a pipeline reports its first error, which a missing
	// key's would hide.
	for _, k := range []string{"c", "r", "p"} {
		ls, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{OnError: OnErrorDeny, Prefix: "listing-" + k + ":"})
		if _, err := ls.Hit(ctx, "damaged", time.Now(), limits["fixed"]); err != nil {
			t.Fatal(err)
		}
		setValue(ctx, t, client, ls.base("", "damaged")+k, hashKey)
		client.Expire(ctx, ls.base("", "damaged")+k, time.Minute)
		listed := map[string]int{}
		if err := ls.Range(ctx, time.Now(), func(ks KeyState) bool { listed[ks.Key] = ks.Count; return true }); err != nil {
			t.Fatalf("listing beside a damaged %s key: %v", k, err)
		}
		want := map[string]int{"damaged": 1}
		if k == "c" {
			want = map[string]int{}
		}
		if !maps.Equal(listed, want) {
			t.Fatalf("listing beside a damaged %s key: %v, want %v", k, listed, want)
		}
	}
}

// A Redis that lost its scripts (SCRIPT FLUSH, as after a restart) answers
// NOSCRIPT: the decision loads the script and decides, on both scripts'
// paths, pipelined or not, with no store error and the count kept.
func TestRedisScriptsReloaded(t *testing.T) {
	t.Parallel()
	srv := redistest.StartReal(t, "SCRIPT FLUSH")
	for _, pipeline := range []bool{false, true} {
		t.Run(fmt.Sprint("pipeline=", pipeline), func(t *testing.T) {
			s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{OnError: OnErrorDeny, Pipeline: pipeline})
			ctx := context.Background()
			for _, lim := range []Limit{{Window: time.Minute, Max: 10}, {Window: time.Minute, Max: 10, Algorithm: SlidingWindow}} {
				key := fmt.Sprint("flushed-", lim.Sliding())
				for i := range 3 {
					if err := client.ScriptFlush(ctx).Err(); err != nil {
						t.Fatal(err)
					}
					v, err := s.Hit(ctx, key, time.Now(), lim)
					if err != nil || v.StoreError || !v.Allowed || v.Remaining != 9-i {
						t.Fatalf("sliding %t, hit %d after SCRIPT FLUSH: %+v, %v; want admitted with %d remaining", lim.Sliding(), i+1, v, err, 9-i)
					}
				}
			}
		})
	}
}

// The decision's two keys are base(name, tag) + "c" and + "r", cut from one
// string (the command holds them as *string), and base is built in one
// allocation of its exact length.
func TestRedisKeysBuiltOnce(t *testing.T) {
	s := &RedisStore{redisCore: redisCore{prefix: "rl:zone:"}}
	now := time.Now()
	for _, name := range []string{"", "burst"} {
		for _, key := range []string{"203.0.113.9", "key:" + strings.Repeat("é", 40)} {
			base := s.base(name, key)
			want := "rl:zone:{" + key + "}:"
			if name != "" {
				want = "rl:zone:@" + name + ":{" + key + "}:"
			}
			if base != want {
				t.Fatalf("base(%q, %q) = %q, want %q", name, key, base, want)
			}
			if n := testing.AllocsPerRun(20, func() { _ = s.base(name, key) }); n != 1 {
				t.Errorf("base(%q, %q) allocates %v times, want 1", name, key, n)
			}
			c := &Check{Name: name, Key: key, Limit: Limit{Max: 10, Window: time.Minute}}
			cmd := s.fixedCmd(c, now)
			ck, ok1 := cmd[3].(*string)
			rk, ok2 := cmd[4].(*string)
			if !ok1 || !ok2 || *ck != base+"c" || *rk != base+"r" {
				t.Errorf("fixedCmd keys %v, %v; want %q, %q", cmd[3], cmd[4], base+"c", base+"r")
			}
		}
	}
}
