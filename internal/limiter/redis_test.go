package limiter

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// testTimeout is a test store's timeout unless the test sets one: long
// enough for any busy host, short enough that a hang fails the test.
const testTimeout = 5 * time.Second

// newTestRedisStore returns a RedisStore on a fresh client to addrs, with
// its probe running until the test ends.
func newTestRedisStore(t testing.TB, addrs []string, opts RedisStoreOptions) (*RedisStore, redis.UniversalClient) {
	t.Helper()
	s := NewRedisStore(testStoreOptions(t, addrs, opts))
	startTestStore(t, &s.redisCore, s)
	return s, s.client
}

// newTestSyncStore is newTestRedisStore for a store in sync mode
// (opts.Sync).
func newTestSyncStore(t testing.TB, addrs []string, opts RedisStoreOptions) (*SyncStore, redis.UniversalClient) {
	t.Helper()
	s := NewSyncStore(testStoreOptions(t, addrs, opts))
	startTestStore(t, &s.redisCore, s)
	return s, s.client
}

// testStoreOptions completes opts for a test store: a client of its own
// on addrs, the test's timeout and a prefix naming the test.
func testStoreOptions(t testing.TB, addrs []string, opts RedisStoreOptions) RedisStoreOptions {
	t.Helper()
	client := redis.NewUniversalClient(&redis.UniversalOptions{
		Addrs:                 addrs,
		ContextTimeoutEnabled: true,
		MaxRetries:            -1,
		DialTimeout:           time.Second,
	})
	t.Cleanup(func() { client.Close() })
	opts.Client = client
	if opts.Timeout == 0 {
		// A decision's own 100ms default fails on a loaded host: tests
		// that time a hung Redis set their timeout.
		opts.Timeout = testTimeout
	}
	if opts.Prefix == "" {
		opts.Prefix = "test:" + t.Name() + ":"
	}
	return opts
}

// startTestStore runs s (whose core is c) until the test ends, probing
// every 50ms.
func startTestStore(t testing.TB, c *redisCore, s Store) {
	c.probeEvery = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	go s.Run(ctx, func() time.Duration { return time.Minute })
}

// listening marks s used and returns once it hears its unblock channel. Its
// first subscription empties the refused cache (it may have missed unblocks
// before it), so a test that counts on the cache must not race it: a
// decision cached before the subscription is forgotten after it.
func listening(t testing.TB, s *RedisStore, client redis.UniversalClient) {
	t.Helper()
	s.markUsed()
	const probe = "listening-probe"
	cached := func() bool {
		sh := s.refused.shard(probe)
		sh.mu.Lock()
		defer sh.mu.Unlock()
		_, ok := sh.m[probe]
		return ok
	}
	// An announcement is heard only after the subscription's emptying:
	// once the probe is gone, either one has happened, and so the first.
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		now := time.Now()
		s.refused.put(probe, now.Add(time.Hour).UnixNano(), 1, false, now.UnixNano())
		client.Publish(context.Background(), s.unblockChannel(), "\x00"+probe)
		for wait := time.Now().Add(100 * time.Millisecond); time.Now().Before(wait); time.Sleep(5 * time.Millisecond) {
			if !cached() {
				return
			}
		}
	}
	t.Fatal("the store never heard its unblock channel")
}

// waitUntil sleeps until from, the earliest cond can hold, then polls cond
// every 10ms until it holds; it fails the test, naming what it waited for,
// when cond still fails after by. It sleeps with srv.Sleep, so that a
// miniredis's keys expire as the test waits; the one sleep to from keeps
// the miniredis's clock from falling behind by a little at every poll. The
// clock is read before cond runs, so a test stalled past by still gets a
// look at the state.
func waitUntil(t testing.TB, srv *redistest.Server, from, by time.Time, what string, cond func() bool) {
	t.Helper()
	srv.Sleep(time.Until(from))
	for {
		late := time.Now().After(by)
		if cond() {
			return
		}
		if late {
			t.Fatalf("%s: not yet %s after the deadline", what, time.Since(by).Round(time.Millisecond))
		}
		srv.Sleep(10 * time.Millisecond)
	}
}

// gone reports whether none of keys exists in Redis.
func gone(ctx context.Context, client redis.UniversalClient, keys ...string) func() bool {
	return func() bool {
		n, err := client.Exists(ctx, keys...).Result()
		return err == nil && n == 0
	}
}

// The Redis store reaches the same verdicts as the memory store: max
// admitted counting down, refusals not counted, FirstRefusal once, a fresh
// window after the reset, and no key outliving its window. The window is
// 600ms, so that the test waits it out in well under a second.
func TestRedisStoreVerdicts(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	listening(t, s, client)
	ctx := context.Background()
	const window = 600 * time.Millisecond
	lim := Limit{Window: window, Max: 3}
	now := time.Now()
	for i := 1; i <= 3; i++ {
		v, err := s.Hit(ctx, "10.0.0.1", now, lim)
		if err != nil {
			t.Fatal(err)
		}
		if !v.Allowed || v.Remaining != 3-i || v.Max != 3 || v.StoreError {
			t.Fatalf("hit %d: %+v, want allowed with %d remaining", i, v, 3-i)
		}
		if d := v.Reset.Sub(now); d <= window/2 || d > window {
			t.Fatalf("hit %d: reset in %s, want about %s", i, d, window)
		}
	}
	v, err := s.Hit(ctx, "10.0.0.1", now, lim)
	if err != nil || v.Allowed || !v.FirstRefusal || v.Remaining != 0 || v.RetryAfter <= 0 || v.RetryAfter > window {
		t.Fatalf("4th hit: %+v, %v; want the first refusal with a retry-after", v, err)
	}
	v, _ = s.Hit(ctx, "10.0.0.1", now, lim)
	if v.Allowed || v.FirstRefusal {
		t.Fatalf("5th hit: %+v, want a refusal that is not the first", v)
	}
	// The refusals were not counted in Redis; the 4th was tallied by the
	// script, the 5th (refused from the local cache, without a round trip)
	// by the next flush of the cache's refusals, here at once.
	base := s.base("", "10.0.0.1")
	if err := s.flushRefused(ctx, now); err != nil {
		t.Fatal(err)
	}
	if n, _ := client.Get(ctx, base+"c").Int(); n != 3 {
		t.Errorf("count in redis = %d, want 3", n)
	}
	if n, _ := client.Get(ctx, base+"r").Int(); n != 2 {
		t.Errorf("refused tally in redis = %d, want 2 (one by the script, one from the cache)", n)
	}
	for _, k := range []string{base + "c", base + "r"} {
		if ttl := client.PTTL(ctx, k).Val(); ttl <= 0 || ttl > window {
			t.Errorf("PTTL %s = %s, want within the %s window", k, ttl, window)
		}
	}
	// Another key is untouched.
	if v, _ := s.Hit(ctx, "10.0.0.2", now, lim); !v.Allowed || v.Remaining != 2 {
		t.Errorf("other key: %+v, want allowed with 2 remaining", v)
	}

	// The window began after now: a third of it on, its keys are gone.
	waitUntil(t, srv, now.Add(window), now.Add(window+window/3), "the keys outlived their window", gone(ctx, client, base+"c", base+"r"))
	v, err = s.Hit(ctx, "10.0.0.1", time.Now(), lim)
	if err != nil || !v.Allowed || v.Remaining != 2 {
		t.Fatalf("after the reset: %+v, %v; want a fresh window", v, err)
	}
}

// A key refused once is refused again without a round trip until its
// window resets: with Redis gone, the verdict is still a plain refusal.
func TestRedisStoreRefusesLocally(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{OnError: OnErrorAllow})
	listening(t, s, client)
	ctx := context.Background()
	lim := Limit{Window: time.Minute, Max: 1}
	now := time.Now()
	s.Hit(ctx, "k", now, lim)
	if v, _ := s.Hit(ctx, "k", now, lim); v.Allowed {
		t.Fatal("2nd hit admitted with max 1")
	}
	srv.Stop()
	for i := range 10 {
		v, err := s.Hit(ctx, "k", now.Add(time.Duration(i)*time.Second), lim)
		if err != nil || v.Allowed || v.StoreError {
			t.Fatalf("refused key with redis down: %+v, %v; want a local refusal", v, err)
		}
	}
	if h := s.Health(); h != HealthHealthy {
		t.Errorf("health = %s after local refusals only, want HEALTHY (redis was never asked)", h)
	}
	// A raised limit does not trust the cache.
	if v, _ := s.Hit(ctx, "k", now, Limit{Window: time.Minute, Max: 5}); !v.StoreError {
		t.Errorf("raised limit: %+v, want a decision that went to (the dead) redis", v)
	}
}

// A key cached as refused under a long window is not refused for that long
// once a reload shortens the window: the decision goes back to Redis,
// whose script clamps the key's expiry to the new window.
func TestRedisStoreRefusedCacheShorterWindow(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	listening(t, s, client)
	ctx := context.Background()
	long := Limit{Window: time.Hour, Max: 1}
	now := time.Now()
	s.Hit(ctx, "k", now, long)
	if v, _ := s.Hit(ctx, "k", now, long); v.Allowed {
		t.Fatal("2nd hit admitted with max 1")
	}
	if v, _ := s.Hit(ctx, "k", now.Add(3*time.Second), long); v.Allowed || v.RetryAfter < 59*time.Minute {
		t.Fatalf("same window 3s on: %+v, want a refusal for about an hour", v)
	}

	const window = 400 * time.Millisecond
	short := Limit{Window: window, Max: 1}
	cut := time.Now()
	v, err := s.Hit(ctx, "k", now.Add(3*time.Second), short)
	if err != nil || v.Allowed || v.StoreError || v.RetryAfter > window {
		t.Fatalf("window shortened to %s: %+v, %v; want a refusal by redis within the window", window, v, err)
	}
	base := s.base("", "k")
	waitUntil(t, srv, cut.Add(window), cut.Add(window+window/3), "the key outlived the shortened window", gone(ctx, client, base+"c"))
	v, err = s.Hit(ctx, "k", now.Add(6*time.Second), short)
	if err != nil || !v.Allowed {
		t.Fatalf("%s window over: %+v, %v; want the key admitted", window, v, err)
	}
}

// After a reload shortens the window (Limit.Since), a key refused under the
// longer one is admitted a new window after the reload, however often it
// comes back in between; the refused tally starts afresh with the window.
func TestRedisStoreWindowShortenedSince(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	listening(t, s, client)
	ctx := context.Background()
	now := time.Now()
	long := Limit{Window: 2 * time.Minute, Max: 2}
	for range 3 {
		s.Hit(ctx, "k", now, long)
	}
	const window = 600 * time.Millisecond
	short := Limit{Window: window, Max: 2, Since: now}
	// The key's first request after the reload comes half a window late:
	// a window counted from it would end half a window after the reload's.
	srv.Sleep(window / 2)
	for range 3 {
		v, err := s.Hit(ctx, "k", time.Now(), short)
		if err != nil || v.Allowed || v.StoreError || v.RetryAfter > window {
			t.Fatalf("after the reload: %+v, %v; want refused by redis within %s", v, err, window)
		}
	}
	base := s.base("", "k")
	waitUntil(t, srv, now.Add(window), now.Add(window+window/4), "the window did not end a window after the reload", gone(ctx, client, base+"c"))
	v, err := s.Hit(ctx, "k", time.Now(), short)
	if err != nil || !v.Allowed || v.Remaining != 1 {
		t.Fatalf("%s after the reload: %+v, %v; want a fresh window", window, v, err)
	}
	var got []KeyState
	s.Range(ctx, time.Now(), func(ks KeyState) bool { got = append(got, ks); return true })
	if len(got) != 1 || got[0].Count != 1 || got[0].Refused != 0 {
		t.Fatalf("listing = %+v, want k with count 1 and no refusals", got)
	}
	// A reload whose window already ended: the old window goes at once.
	for range 3 {
		s.Hit(ctx, "j", time.Now(), long)
	}
	gone := Limit{Window: time.Second, Max: 2, Since: time.Now().Add(-time.Second)}
	if v, err := s.Hit(ctx, "j", time.Now(), gone); err != nil || !v.Allowed || v.Remaining != 1 {
		t.Fatalf("window already over: %+v, %v; want a fresh window", v, err)
	}
}

// A Redis that answers PING but fails every decision (here: out of memory)
// keeps the store DEGRADED: the probe runs the decision script, so the
// store does not cycle through RECOVERING. Once Redis takes writes again
// the store is HEALTHY by itself.
func TestRedisStoreProbeUsesScript(t *testing.T) {
	srv := redistest.StartReal(t, "miniredis has no maxmemory")
	core, logs := observer.New(zap.InfoLevel)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{OnError: OnErrorAllow, Logger: zap.New(core)})
	ctx := context.Background()
	lim := Limit{Window: time.Minute, Max: 10}
	if v, err := s.Hit(ctx, "warm", time.Now(), lim); err != nil || v.StoreError {
		t.Fatalf("first hit: %+v, %v", v, err)
	}
	for _, kv := range [][2]string{{"maxmemory-policy", "noeviction"}, {"maxmemory", "1"}} {
		if err := client.ConfigSet(ctx, kv[0], kv[1]).Err(); err != nil {
			t.Fatal(err)
		}
	}
	if err := client.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING under maxmemory 1: %v, want PONG", err)
	}
	if err := client.Incr(ctx, "oom-check").Err(); err == nil || !strings.Contains(err.Error(), "OOM") {
		t.Fatalf("INCR under maxmemory 1: %v, want OOM", err)
	}

	for i := range degradeAfter {
		if v, _ := s.Hit(ctx, fmt.Sprintf("oom-%d", i), time.Now(), lim); !v.StoreError {
			t.Fatalf("hit %d under OOM: %+v, want a store error", i, v)
		}
	}
	// Twenty probe intervals: the health never leaves DEGRADED.
	for deadline := time.Now().Add(20 * s.probeEvery); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		if h := s.Health(); h != HealthDegraded {
			t.Fatalf("health = %s while redis is out of memory, want DEGRADED", h)
		}
	}
	if n := logs.FilterMessageSnippet("redis store degraded").Len(); n != 1 {
		t.Errorf("%d changes to DEGRADED logged, want 1", n)
	}
	if n := logs.FilterMessageSnippet("redis store recovering").Len(); n != 0 {
		t.Errorf("%d changes to RECOVERING logged while redis is out of memory, want 0", n)
	}

	if err := client.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); s.Health() != HealthHealthy; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("health = %s 5s after redis took writes again, want HEALTHY", s.Health())
		}
	}
	// The probe key is not a client's: the listing skips it.
	err := s.Range(ctx, time.Now(), func(ks KeyState) bool {
		if ks.Key == probeTag {
			t.Errorf("Range lists the probe key: %+v", ks)
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
}

// The refusals answered in-process are added to Redis in pages of plain
// pipelines, not one transaction, each tally expiring when its window
// resets; a window that has reset by the flush is not written.
func TestRedisStoreFlushRefusedPages(t *testing.T) {
	srv := redistest.Start(t)
	_, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	// Not running: Run's own flush must not drain the cache first.
	s := NewRedisStore(RedisStoreOptions{Client: client, Prefix: "flush:"})
	ctx := context.Background()
	now := time.Now()
	c := Check{Limit: Limit{Window: time.Minute, Max: 1}}
	keys := 2*flushPage + 7
	for i := range keys {
		k := fmt.Sprintf("10.2.%d.%d", i/256, i%256)
		s.refused.put(k, now.Add(10*time.Second).UnixNano(), 1, true, now.UnixNano())
		s.refused.get(k, now.UnixNano(), &c)
		s.refused.get(k, now.UnixNano(), &c)
	}
	s.refused.put("gone", now.Add(time.Second).UnixNano(), 1, true, now.UnixNano())
	s.refused.get("gone", now.UnixNano(), &c)
	if srv.Kind == redistest.KindReal {
		if err := client.ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}

	flushed := time.Now()
	if err := s.flushRefused(ctx, now.Add(2*time.Second)); err != nil {
		t.Fatal(err)
	}
	for i := range keys {
		k := s.base("", fmt.Sprintf("10.2.%d.%d", i/256, i%256)) + "r"
		if n, _ := client.Get(ctx, k).Int(); n != 2 {
			t.Fatalf("tally of %s = %d, want 2", k, n)
		}
		// 8s from the flush: less what has passed since, however
		// slowly a loaded host reads the keys back.
		ttl := client.PTTL(ctx, k).Val()
		if least := 8*time.Second - time.Since(flushed) - 10*time.Millisecond; ttl < least || ttl > 8*time.Second {
			t.Fatalf("PTTL %s = %s, want from %s to 8s (the reset 10s on, flushed 2s on)", k, ttl, least)
		}
	}
	if n := client.Exists(ctx, s.base("", "gone")+"r").Val(); n != 0 {
		t.Error("a tally was written for a window that had reset")
	}
	if srv.Kind == redistest.KindReal {
		info := client.Info(ctx, "commandstats").Val()
		if strings.Contains(info, "cmdstat_multi:") {
			t.Errorf("the flush ran a transaction:\n%s", info)
		}
	}
	// Drained: a second flush writes nothing.
	if err := s.flushRefused(ctx, now.Add(2*time.Second)); err != nil {
		t.Fatal(err)
	}
	if n, _ := client.Get(ctx, s.base("", "10.2.0.0")+"r").Int(); n != 2 {
		t.Errorf("tally after a second flush = %d, want 2", n)
	}
}

// A flood from a key over its limit costs Redis nothing: after the first
// refusal, every refusal is decided in-process.
func TestRedisStoreFloodCostsNothing(t *testing.T) {
	srv := redistest.StartReal(t, "miniredis keeps no command statistics")
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	listening(t, s, client)
	ctx := context.Background()
	lim := Limit{Window: time.Minute, Max: 3}
	if err := client.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	refused := 0
	for range 1000 {
		v, err := s.Hit(ctx, "flooder", time.Now(), lim)
		if err != nil {
			t.Fatal(err)
		}
		if !v.Allowed {
			refused++
		}
	}
	if refused != 997 {
		t.Fatalf("refused %d of 1000 with max 3, want 997", refused)
	}
	info, err := client.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	for _, line := range strings.Split(info, "\n") {
		for _, cmd := range []string{"cmdstat_evalsha:", "cmdstat_eval:"} {
			if rest, ok := strings.CutPrefix(line, cmd); ok {
				// EVALSHA's NOSCRIPT on first use is a failed call.
				var n, failed int
				fmt.Sscanf(rest, "calls=%d", &n)
				if i := strings.Index(rest, "failed_calls="); i >= 0 {
					fmt.Sscanf(rest[i:], "failed_calls=%d", &failed)
				}
				calls += n - failed
			}
		}
	}
	if calls != 4 {
		t.Errorf("redis ran the script %d times for 1000 requests with max 3, want 4 (3 admitted, 1 refused)\n%s", calls, info)
	}
}

// Many goroutines hitting one key through several stores (as several Caddy
// instances would) admit exactly max.
func TestRedisStoreExactAdmission(t *testing.T) {
	srv := redistest.Start(t)
	testExactAdmission(t, []string{srv.Addr})
}

// The same on a three-master Redis Cluster, with several keys so that
// several slots and nodes are involved.
func TestRedisStoreClusterAdmission(t *testing.T) {
	addrs := redistest.StartCluster(t)
	testExactAdmission(t, addrs)

	// Range covers every master.
	s, _ := newTestRedisStore(t, addrs, RedisStoreOptions{Prefix: "range:"})
	ctx := context.Background()
	lim := Limit{Window: time.Minute, Max: 10}
	for i := range 50 {
		if _, err := s.Hit(ctx, fmt.Sprintf("10.1.0.%d", i), time.Now(), lim); err != nil {
			t.Fatal(err)
		}
	}
	seen := 0
	if err := s.Range(ctx, time.Now(), func(KeyState) bool { seen++; return true }); err != nil {
		t.Fatal(err)
	}
	if seen != 50 {
		t.Errorf("Range on the Cluster saw %d keys, want 50", seen)
	}
}

func testExactAdmission(t *testing.T, addrs []string) {
	const stores, clients, perClient, maxN = 2, 64, 10, 50
	var ss []*RedisStore
	for range stores {
		s, _ := newTestRedisStore(t, addrs, RedisStoreOptions{Prefix: "exact:", Timeout: 2 * time.Second})
		ss = append(ss, s)
	}
	for _, key := range []string{"198.51.100.7", "2001:db8::/64", "user:alice"} {
		var admitted, refused, failed atomic.Int64
		var wg sync.WaitGroup
		lim := Limit{Window: time.Minute, Max: maxN}
		for c := range clients {
			wg.Go(func() {
				s := ss[c%stores]
				for range perClient {
					v, err := s.Hit(context.Background(), key, time.Now(), lim)
					switch {
					case err != nil || v.StoreError:
						failed.Add(1)
					case v.Allowed:
						admitted.Add(1)
					default:
						refused.Add(1)
					}
				}
			})
		}
		wg.Wait()
		if admitted.Load() != maxN || failed.Load() != 0 || refused.Load() != clients*perClient-maxN {
			t.Errorf("key %s: admitted %d, refused %d, failed %d; want exactly %d admitted and no failure",
				key, admitted.Load(), refused.Load(), failed.Load(), maxN)
		}
	}
}

// Each on_error mode does what it says while Redis is down, no decision
// waits longer than the timeout, and the store walks DEGRADED → RECOVERING →
// HEALTHY by itself once Redis is back.
func TestRedisStoreOnError(t *testing.T) {
	for _, mode := range []string{OnErrorLocal, OnErrorAllow, OnErrorDeny} {
		t.Run(mode, func(t *testing.T) {
			srv := redistest.Start(t)
			const timeout = 100 * time.Millisecond
			s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{OnError: mode, Timeout: timeout})
			ctx := context.Background()
			lim := Limit{Window: time.Minute, Max: 3}
			if v, err := s.Hit(ctx, "warm", time.Now(), lim); err != nil || !v.Allowed {
				t.Fatalf("warm-up: %+v, %v", v, err)
			}
			srv.Stop()

			var slowest time.Duration
			var verdicts []Verdict
			var errs []error
			for range 8 {
				start := time.Now()
				v, err := s.Hit(ctx, "10.9.9.9", time.Now(), lim)
				slowest = max(slowest, time.Since(start))
				verdicts = append(verdicts, v)
				errs = append(errs, err)
			}
			if slowest > timeout+200*time.Millisecond {
				t.Errorf("a decision took %s with redis down, want at most the %s timeout (plus slack)", slowest, timeout)
			}
			if h := s.Health(); h != HealthDegraded {
				t.Errorf("health after 8 failures = %s, want DEGRADED", h)
			}
			for i, v := range verdicts {
				switch mode {
				case OnErrorAllow:
					if errs[i] != nil || !v.Allowed || !v.StoreError {
						t.Errorf("allow, request %d: %+v, %v; want admitted with StoreError", i+1, v, errs[i])
					}
				case OnErrorDeny:
					if errs[i] == nil || v.Allowed {
						t.Errorf("deny, request %d: %+v, %v; want an error", i+1, v, errs[i])
					}
				case OnErrorLocal:
					if errs[i] != nil || !v.StoreError || v.Allowed != (i < 3) {
						t.Errorf("local, request %d: %+v, %v; want the local store's verdict (3 admitted)", i+1, v, errs[i])
					}
				}
			}
			if mode == OnErrorDeny && !errors.Is(errs[len(errs)-1], ErrRedisDegraded) {
				t.Errorf("deny once degraded: error %v, want ErrRedisDegraded", errs[len(errs)-1])
			}

			srv.Restart()
			deadline := time.Now().Add(5 * time.Second)
			sawRecovering := false
			for s.Health() != HealthHealthy {
				if s.Health() == HealthRecovering {
					sawRecovering = true
				}
				if time.Now().After(deadline) {
					t.Fatalf("health = %s 5s after redis came back, want HEALTHY", s.Health())
				}
				time.Sleep(5 * time.Millisecond)
			}
			if !sawRecovering {
				t.Log("RECOVERING was too brief to observe")
			}
			v, err := s.Hit(ctx, "10.9.9.10", time.Now(), lim)
			if err != nil || !v.Allowed || v.StoreError {
				t.Errorf("after recovery: %+v, %v; want a redis decision", v, err)
			}
		})
	}
}

// A Redis that hangs rather than dies costs each decision at most the
// timeout, then none once the store is degraded; it recovers when Redis
// answers again.
func TestRedisStoreHungRedis(t *testing.T) {
	for _, pipeline := range []bool{false, true} {
		t.Run(fmt.Sprintf("pipeline=%t", pipeline), func(t *testing.T) { testHungRedis(t, pipeline) })
	}
}

// testHungRedis checks that every decision against a hung Redis ends at its
// timeout, one by one or through the auto-pipeliner.
func testHungRedis(t *testing.T, pipeline bool) {
	srv := redistest.Start(t)
	const timeout = 100 * time.Millisecond
	s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{OnError: OnErrorAllow, Timeout: timeout, Pipeline: pipeline})
	ctx := context.Background()
	lim := Limit{Window: time.Minute, Max: 100}
	if _, err := s.Hit(ctx, "warm", time.Now(), lim); err != nil {
		t.Fatal(err)
	}
	if !srv.Pause() {
		t.Skipf("%s cannot be paused", srv.Kind)
	}
	t.Cleanup(srv.Resume)
	var timings []time.Duration
	var wg sync.WaitGroup
	var mu sync.Mutex
	for c := range 16 {
		wg.Go(func() {
			for range 4 {
				start := time.Now()
				v, err := s.Hit(ctx, fmt.Sprintf("hung-%d", c), time.Now(), lim)
				d := time.Since(start)
				if err != nil || !v.Allowed || !v.StoreError {
					t.Errorf("hung redis, allow: %+v, %v; want admitted with StoreError", v, err)
				}
				mu.Lock()
				timings = append(timings, d)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for _, d := range timings {
		if d > timeout+200*time.Millisecond {
			t.Errorf("a decision took %s against a hung redis, want at most the %s timeout (plus slack)", d, timeout)
		}
	}
	if h := s.Health(); h != HealthDegraded {
		t.Fatalf("health = %s, want DEGRADED", h)
	}
	start := time.Now()
	s.Hit(ctx, "degraded", time.Now(), lim)
	if d := time.Since(start); d > 50*time.Millisecond {
		t.Errorf("a degraded store waited %s on redis, want no wait", d)
	}
	srv.Resume()
	deadline := time.Now().Add(5 * time.Second)
	for s.Health() != HealthHealthy {
		if time.Now().After(deadline) {
			t.Fatalf("health = %s 5s after redis resumed, want HEALTHY", s.Health())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Range lists live keys with their counts via SCAN; Forget resets a key;
// with hash_keys Redis holds no client key, Range lists hashes, and Forget
// takes either the key or its hash.
func TestRedisStoreRangeForget(t *testing.T) {
	for _, hashed := range []bool{false, true} {
		t.Run(fmt.Sprintf("hashed=%t", hashed), func(t *testing.T) {
			srv := redistest.Start(t)
			var secret []byte
			if hashed {
				secret = []byte("s3cret")
			}
			s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{HashKey: secret, Prefix: "rf[1]*:"})
			// A key of another zone sharing the prefix's start must not be
			// listed: the prefix is matched literally.
			client.Set(context.Background(), "rf[1]X:{x}:c", 1, time.Minute)
			ctx := context.Background()
			lim := Limit{Window: time.Minute, Max: 2}
			now := time.Now()
			keys := []string{"192.0.2.1", "192.0.2.2", "2001:db8:1::/64"}
			for i, k := range keys {
				for range i + 1 {
					s.Hit(ctx, k, now, lim)
				}
			}
			got := map[string]KeyState{}
			if err := s.Range(ctx, now, func(ks KeyState) bool { got[ks.Key] = ks; return true }); err != nil {
				t.Fatal(err)
			}
			if len(got) != 3 {
				t.Fatalf("Range listed %d keys, want 3: %v", len(got), got)
			}
			for i, k := range keys {
				name := k
				if hashed {
					name = s.tag(k)
					if _, ok := got[k]; ok {
						t.Errorf("hashed store listed the raw key %s", k)
					}
				}
				ks, ok := got[name]
				if !ok {
					t.Errorf("key %s (listed as %s) missing", k, name)
					continue
				}
				wantCount, wantRefused := min(i+1, 2), max(i+1-2, 0)
				if ks.Count != wantCount || ks.Refused != wantRefused || ks.Reset.Sub(now) <= 50*time.Second {
					t.Errorf("key %s: %+v, want count %d, refused %d, reset in ~1m", k, ks, wantCount, wantRefused)
				}
			}
			if hashed {
				raw, _ := client.Keys(ctx, "*192.0.2*").Result()
				if len(raw) != 0 {
					t.Errorf("redis holds raw client keys: %v", raw)
				}
			}
			// Stop early.
			n := 0
			s.Range(ctx, now, func(KeyState) bool { n++; return false })
			if n != 1 {
				t.Errorf("Range called fn %d times after it returned false, want 1", n)
			}

			// Forget the refused key (by its hash when hashed): it is
			// admitted again at once.
			forget := keys[2]
			if hashed {
				forget = s.tag(keys[2])
			}
			if ok, err := s.Forget(ctx, forget); err != nil || !ok {
				t.Fatalf("Forget(%s) = %t, %v; want true", forget, ok, err)
			}
			if v, _ := s.Hit(ctx, keys[2], now, lim); !v.Allowed || v.Remaining != 1 {
				t.Errorf("after Forget: %+v, want a fresh window", v)
			}
			if ok, _ := s.Forget(ctx, "203.0.113.99"); ok {
				t.Error("Forget of an unknown key reported true")
			}
		})
	}
}

// Nothing connects before the first decision: a store pointing at a dead
// address is built without error and fails only when used.
func TestRedisStoreLazy(t *testing.T) {
	ln := redistest.Listen(t) // takes connections and drops them: not Redis
	clk := clock.NewFake(time.Now())
	s, _ := newTestRedisStore(t, []string{ln.Addr}, RedisStoreOptions{OnError: OnErrorDeny, Clock: clk})
	// Every timer of the store's background work fires: the flushes, the
	// probes, the counts. Nothing of it connects.
	for range 10 {
		clk.Advance(refusedFlushEvery)
		time.Sleep(5 * time.Millisecond) // each firing's goroutine runs
	}
	if n := ln.Accepted(); n != 0 {
		t.Fatalf("%d connections before any decision, want none", n)
	}
	if h := s.Health(); h != HealthHealthy {
		t.Errorf("health before any decision = %s, want HEALTHY", h)
	}
	_, err := s.Hit(context.Background(), "k", time.Now(), Limit{Window: time.Minute, Max: 1})
	if err == nil || !strings.Contains(err.Error(), "redis store") {
		t.Errorf("Hit against an address that is not Redis: %v, want a redis store error", err)
	}
	if ln.Accepted() == 0 {
		t.Error("the first decision made no connection: the listener counts nothing")
	}
}

// BenchmarkRedisHit measures one decision against a real redis-server: a
// round trip with the Lua script, serially and from parallel goroutines,
// spread over many keys so that few are refused.
func BenchmarkRedisHit(b *testing.B) {
	srv := redistest.Start(b)
	if srv.Kind != redistest.KindReal {
		b.Logf("benchmarking %s, not a real redis-server", srv.Kind)
	}
	s, _ := newTestRedisStore(b, []string{srv.Addr}, RedisStoreOptions{Timeout: time.Second})
	lim := Limit{Window: time.Minute, Max: 1 << 30}
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = fmt.Sprintf("10.0.%d.%d", i/256, i%256)
	}
	ctx := context.Background()
	b.Run("serial", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if _, err := s.Hit(ctx, keys[i%len(keys)], time.Now(), lim); err != nil {
				b.Fatal(err)
			}
			i++
		}
	})
	b.Run("parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				if _, err := s.Hit(ctx, keys[i%len(keys)], time.Now(), lim); err != nil {
					b.Error(err)
					return
				}
				i++
			}
		})
	})
	// 32 callers at once (16 per core), as a busy server has: with the
	// auto-pipeliner, their decisions share round trips.
	// In sync mode no decision waits for Redis: the keys are synced
	// every 100ms in the background.
	piped, _ := newTestRedisStore(b, []string{srv.Addr}, RedisStoreOptions{Timeout: time.Second, Pipeline: true, Prefix: "bench-piped:"})
	synced, _ := newTestSyncStore(b, []string{srv.Addr}, RedisStoreOptions{Timeout: time.Second, Sync: 100 * time.Millisecond, Prefix: "bench-sync:"})
	for _, tc := range []struct {
		name  string
		store interface {
			Hit(ctx context.Context, key string, now time.Time, limit Limit) (Verdict, error)
		}
	}{{"concurrent-32/pipelined", piped}, {"concurrent-32/one-by-one", s}, {"concurrent-32/sync-100ms", synced}} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			b.SetParallelism(16)
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					if _, err := tc.store.Hit(ctx, keys[i%len(keys)], time.Now(), lim); err != nil {
						b.Error(err)
						return
					}
					i++
				}
			})
		})
	}
	b.Run("refused-locally", func(b *testing.B) {
		b.ReportAllocs()
		one := Limit{Window: time.Minute, Max: 1}
		s.Hit(ctx, "flood", time.Now(), one)
		s.Hit(ctx, "flood", time.Now(), one)
		for b.Loop() {
			if v, _ := s.Hit(ctx, "flood", time.Now(), one); v.Allowed {
				b.Fatal("flood admitted")
			}
		}
	})
}

// Leases: the cap holds, a lease Redis lost is taken again at its renewal
// (its socket still lives), the set lives as long as its longest lease,
// and a released lease frees its place.
func TestRedisLeases(t *testing.T) {
	srv := redistest.StartReal(t, "leases are tested against a real redis-server")
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	ctx := context.Background()
	long, ok, err := s.AcquireLease(ctx, "k", 2, time.Hour)
	if err != nil || !ok {
		t.Fatalf("first lease: %v %v", ok, err)
	}
	short, ok, _ := s.AcquireLease(ctx, "k", 2, 3*time.Second)
	if !ok {
		t.Fatal("second lease refused under a cap of 2")
	}
	if _, ok, _ := s.AcquireLease(ctx, "k", 2, time.Hour); ok {
		t.Fatal("a third lease admitted over a cap of 2")
	}
	if err := s.ReleaseLease(ctx, short); err != nil {
		t.Fatal(err)
	}
	if ttl := client.PTTL(ctx, long.key).Val(); ttl < 59*time.Minute {
		t.Fatalf("the set expires in %s with an hour-long lease in it", ttl)
	}
	// Redis loses everything (a restart without persistence).
	client.FlushAll(ctx)
	if lost, err := s.RenewLease(ctx, long, time.Hour); err != nil || !lost {
		t.Fatalf("renewing a lost lease: lost %v, %v", lost, err)
	}
	if n := client.ZCard(ctx, long.key).Val(); n != 1 {
		t.Fatalf("after the renewal the set holds %d leases, want the renewed one", n)
	}
}

// The unblock subscription ends with the store: no goroutine or connection
// is left behind a zone that is gone.
func TestRedisListenStops(t *testing.T) {
	srv := redistest.StartReal(t, "miniredis keeps no pub/sub counts")
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	s := NewRedisStore(RedisStoreOptions{Client: client, Prefix: "listen:"})
	ctx, cancel := context.WithCancel(context.Background())
	go s.Run(ctx, func() time.Duration { return time.Minute })
	s.Hit(context.Background(), "k", time.Now(), Limit{Window: time.Minute, Max: 5})
	subscribers := func() int64 {
		return client.PubSubNumSub(context.Background(), s.unblockChannel()).Val()[s.unblockChannel()]
	}
	deadline := time.Now().Add(5 * time.Second)
	for subscribers() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the store never subscribed")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	for subscribers() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the subscription outlived the store")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A refusal the in-process cache answers settles a ban exactly as the
// script would: a key over its limit under a check that started no ban (a
// dry run) is banned at its first refusal by a check that bans, and a
// NoBan check answered from the cache still reports the pending ban.
func TestRedisRefusedCacheSettlesBans(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	listening(t, s, client)
	ctx := context.Background()
	now := time.Now()
	c := Check{Key: "10.9.0.1", Limit: Limit{Window: time.Minute, Max: 2, Ban: time.Hour}, NoBan: true}
	decide := func(c Check) Verdict {
		t.Helper()
		var out [1]Verdict
		if err := s.Decide(ctx, []Check{c}, now, out[:]); err != nil {
			t.Fatal(err)
		}
		return out[0]
	}
	for range 2 {
		if v := decide(c); !v.Allowed {
			t.Fatalf("dry run within max: %+v, want admitted", v)
		}
	}
	for i := range 2 { // the script's refusal, then the cache's
		if v := decide(c); v.Allowed || !v.PendingBan || v.RetryAfter > time.Minute {
			t.Fatalf("dry-run refusal %d: %+v, want refused until the window's end, ban pending", i+1, v)
		}
	}
	if n := client.Exists(ctx, s.base("", s.tag(c.Key))+"b").Val(); n != 0 {
		t.Fatal("a NoBan refusal wrote a ban")
	}
	c.NoBan = false
	for i := range 2 {
		if v := decide(c); v.Allowed || v.PendingBan || v.RetryAfter < 59*time.Minute {
			t.Fatalf("live refusal %d: %+v, want refused for the ban's hour", i+1, v)
		}
	}
	if ttl := client.PTTL(ctx, s.base("", s.tag(c.Key))+"b").Val(); ttl < 59*time.Minute {
		t.Fatalf("ban key's TTL %s, want about an hour", ttl)
	}
}
