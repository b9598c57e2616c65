package limiter

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// The lean script (redis_fixed.lua) against the general one (redis.lua) with
// one fixed-window check that does not ban, on a real Redis: from the same
// keys (none, a count in or over its window, one without an expiry, a GCRA
// arrival time, a refused tally), with every cutoff and cost, both return the
// same results and leave the same keys behind, in every combination.
func TestRedisFixedScriptMatchesGeneral(t *testing.T) {
	t.Parallel()
	srv := redistest.StartReal(t, "the scripts' equivalence needs a real Redis")
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	// within reports whether two times to live, read a moment apart, agree.
	within := func(a, b int64) bool { return a == b || (a > 0 && b > 0 && a-b < 200 && b-a < 200) }
	maxes, windows := []int{1, 2, 5}, []int64{1000, 5000}
	cutoffs := []int64{-1, 0, 500, 3000, 10_000}
	counts := []string{"", "0", "1", "4", "5", "6", "3000000000"}
	ttls := []int64{0, 300, 2000, 8000} // 0: no expiry
	refuseds := []string{"", "1", "7"}
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
		var state [2][4]int64
		for side, script := range []*redis.Script{hitScript, fixedScript} {
			base := fmt.Sprintf("{t%d-%d}:", i, side)
			c, rk := base+"c", base+"r"
			if count != "" {
				client.Set(ctx, c, count, 0)
				if ttl > 0 {
					client.PExpire(ctx, c, time.Duration(ttl)*time.Millisecond)
				}
			}
			if refused != "" {
				client.Set(ctx, rk, refused, time.Duration(window)*time.Millisecond)
			}
			keys := []string{c, rk}
			args := []any{max, window, cutoff, cost}
			if script == hitScript {
				keys = append(keys, base+"p")
				args = []any{max, window, cutoff, 0, cost, 0, ""}
			}
			var err error
			res[side], err = script.Run(ctx, client, keys, args...).Int64Slice()
			if err != nil {
				t.Fatalf("case %d, side %d: %v", i, side, err)
			}
			cv, _ := client.Get(ctx, c).Int64()
			rv, _ := client.Get(ctx, rk).Int64()
			pttl := func(k string) int64 { v, _ := client.Do(ctx, "PTTL", k).Int64(); return v }
			state[side] = [4]int64{cv, pttl(c), rv, pttl(rk)}
		}
		a, b := res[0], res[1]
		same := len(a) == 7 && len(b) == 7 && within(a[2], b[2])
		for j := range min(len(a), len(b)) {
			same = same && (j == 2 || a[j] == b[j])
		}
		same = same && state[0][0] == state[1][0] && state[0][2] == state[1][2] &&
			within(state[0][1], state[1][1]) && within(state[0][3], state[1][3])
		if !same {
			t.Fatalf("case %d (max %d, window %d, cutoff %d, cost %d, count %q ttl %d, refused %q):\n general %v, keys %v\n fixed   %v, keys %v",
				i, max, window, cutoff, cost, count, ttl, refused, a, state[0], b, state[1])
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
			for _, lim := range []Limit{{Window: time.Minute, Max: 10}, {Window: time.Minute, Max: 10, Sliding: true}} {
				key := fmt.Sprint("flushed-", lim.Sliding)
				for i := range 3 {
					if err := client.ScriptFlush(ctx).Err(); err != nil {
						t.Fatal(err)
					}
					v, err := s.Hit(ctx, key, time.Now(), lim)
					if err != nil || v.StoreError || !v.Allowed || v.Remaining != 9-i {
						t.Fatalf("sliding %t, hit %d after SCRIPT FLUSH: %+v, %v; want admitted with %d remaining", lim.Sliding, i+1, v, err, 9-i)
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
	s := &RedisStore{prefix: "rl:zone:"}
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
