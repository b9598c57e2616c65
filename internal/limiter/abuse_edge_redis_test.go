package limiter

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// A banned key of a sliding limit stays listed once its window has ended
// (its count key lives on a window longer), on Redis as in memory. The
// window is 300ms; the ban, 5s, outlasts the test.
func TestEdgeRedisSlidingBanListing(t *testing.T) {
	srv := redistest.StartReal(t, "real")
	const window = 300 * time.Millisecond
	lim := Limit{Window: window, Max: 1, Algorithm: SlidingWindow, Ban: 5 * time.Second}
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 2 * time.Second})
	s.SetLimits([]Check{{Limit: lim}})
	c := Check{Key: "203.0.113.9", Limit: lim}
	start := time.Now()
	decide(t, s, time.Now(), c)
	if _, ok := decide(t, s, time.Now(), c); ok {
		t.Fatal("second admitted")
	}
	// Listed just after the window's end, when the count key has a window
	// or less to live: the listing's case of a count key whose window has
	// ended (a window later the key is gone and the ban key is listed).
	count := s.base("", c.Key) + "c"
	waitUntil(t, srv, start.Add(window), start.Add(window+window/2), "the window did not end", func() bool {
		ttl, err := client.PTTL(context.Background(), count).Result()
		return err == nil && ttl <= window
	})
	var got []KeyState
	s.Range(context.Background(), time.Now(), func(ks KeyState) bool { got = append(got, ks); return true })
	if len(got) != 1 || got[0].BannedUntil.IsZero() {
		t.Errorf("Redis listing after the window: %+v, want the key, banned", got)
	}
	m := NewMemoryStore(100)
	now := time.Now()
	decide(t, m, now, c)
	decide(t, m, now, c)
	got = nil
	m.Range(context.Background(), now.Add(window*13/10), func(ks KeyState) bool { got = append(got, ks); return true })
	if len(got) != 1 || got[0].BannedUntil.IsZero() {
		t.Errorf("memory listing 1.3 windows in: %+v, want the key, banned", got)
	}
}

// A GCRA refund credits only the units not yet dripped back, on Redis as in
// memory (TestEdgeGCRARefundOverCredit). One unit per 300ms: E, a fifth
// of that after D, has 240ms to come before a unit drips back anyway.
func TestEdgeRedisGCRARefundOverCredit(t *testing.T) {
	srv := redistest.StartReal(t, "real")
	const interval = 300 * time.Millisecond
	lim := Limit{Window: interval, Max: 1, Algorithm: GCRA, Burst: 1}
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 2 * time.Second})
	s.SetLimits([]Check{{Limit: lim}})
	c := Check{Key: "203.0.113.10", Limit: lim}
	t0 := time.Now()
	outA, ok := decide(t, s, t0, c)
	if !ok {
		t.Fatal("A refused")
	}
	// A's unit has dripped back once the bucket's key is gone: it
	// expires when the bucket is full again.
	waitUntil(t, srv, t0.Add(interval), t0.Add(2*interval), "A's unit did not drip back", gone(context.Background(), client, s.base("", c.Key)+"c"))
	d := time.Now()
	if _, ok := decide(t, s, time.Now(), c); !ok {
		t.Fatal("D refused")
	}
	time.Sleep(interval / 5)
	s.Refund(context.Background(), []Check{c}, time.Now(), outA)
	if _, ok := decide(t, s, time.Now(), c); ok {
		t.Errorf("E admitted %s after D with one unit per %s, burst 1", time.Since(d).Round(time.Millisecond), interval)
	}
}

// A costly refusal is not cached: a cheap request that fits later is
// admitted, on Redis as in memory. One unit drips back per 100ms, so the
// cheap request comes about 100ms after a refusal that said to wait 1s.
func TestEdgeRedisCostlyRefusalNotCached(t *testing.T) {
	srv := redistest.StartReal(t, "real")
	const interval = 100 * time.Millisecond
	lim := Limit{Window: 10 * interval, Max: 10, Algorithm: GCRA} // burst 10
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 2 * time.Second})
	listening(t, s, client)
	s.SetLimits([]Check{{Limit: lim}})
	c := Check{Key: "203.0.113.11", Limit: lim, Cost: 10}
	t0 := time.Now()
	if _, ok := decide(t, s, time.Now(), c); !ok {
		t.Fatal("first refused")
	}
	if _, ok := decide(t, s, time.Now(), c); ok { // empty bucket, cost 10: a wait of about 10 units
		t.Fatal("a costly request admitted by an empty bucket")
	}
	// One unit has dripped back once the bucket's key, which expires
	// when the bucket is full again, has 9 units or less to live.
	bucket := s.base("", c.Key) + "c"
	waitUntil(t, srv, t0.Add(interval), t0.Add(2*interval), "no unit dripped back", func() bool {
		ttl, err := client.PTTL(context.Background(), bucket).Result()
		return err == nil && ttl <= 9*interval
	})
	c.Cost = 1
	if _, ok := decide(t, s, time.Now(), c); !ok {
		t.Errorf("a request of cost 1 refused from the cache %s later, though one unit dripped back", time.Since(t0).Round(time.Millisecond))
	}
	m := NewMemoryStore(100)
	now := time.Now()
	c.Cost = 10
	decide(t, m, now, c)
	decide(t, m, now, c)
	c.Cost = 1
	if _, ok := decide(t, m, now.Add(interval*11/10), c); !ok {
		t.Errorf("memory: a request of cost 1 refused 1.1 units after a costly refusal")
	}
}
