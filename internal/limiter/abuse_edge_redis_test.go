package limiter

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// A banned key of a sliding limit stays listed once its window has ended
// (its count key lives on a window longer), on Redis as in memory.
func TestEdgeRedisSlidingBanListing(t *testing.T) {
	srv := redistest.StartReal(t, "real")
	lim := Limit{Window: time.Second, Max: 1, Sliding: true, Ban: 5 * time.Second}
	s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 2 * time.Second})
	s.SetLimits([]Check{{Limit: lim}})
	c := Check{Key: "203.0.113.9", Limit: lim}
	decide(t, s, time.Now(), c)
	if _, ok := decide(t, s, time.Now(), c); ok {
		t.Fatal("second admitted")
	}
	time.Sleep(1300 * time.Millisecond)
	var got []KeyState
	s.Range(context.Background(), time.Now(), func(ks KeyState) bool { got = append(got, ks); return true })
	if len(got) != 1 || got[0].BannedUntil.IsZero() {
		t.Errorf("Redis listing 1.3s in: %+v, want the key, banned", got)
	}
	m := NewMemoryStore(100)
	now := time.Now()
	decide(t, m, now, c)
	decide(t, m, now, c)
	got = nil
	m.Range(context.Background(), now.Add(1300*time.Millisecond), func(ks KeyState) bool { got = append(got, ks); return true })
	if len(got) != 1 || got[0].BannedUntil.IsZero() {
		t.Errorf("memory listing 1.3s in: %+v, want the key, banned", got)
	}
}

// A GCRA refund credits only the units not yet dripped back, on Redis as in
// memory (TestEdgeGCRARefundOverCredit).
func TestEdgeRedisGCRARefundOverCredit(t *testing.T) {
	srv := redistest.StartReal(t, "real")
	lim := Limit{Window: time.Second, Max: 1, GCRA: true, Burst: 1} // one per second
	s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 2 * time.Second})
	s.SetLimits([]Check{{Limit: lim}})
	c := Check{Key: "203.0.113.10", Limit: lim}
	t0 := time.Now()
	outA, ok := decide(t, s, t0, c)
	if !ok {
		t.Fatal("A refused")
	}
	time.Sleep(1200 * time.Millisecond)
	if _, ok := decide(t, s, time.Now(), c); !ok {
		t.Fatal("D refused")
	}
	time.Sleep(200 * time.Millisecond)
	s.Refund(context.Background(), []Check{c}, time.Now(), outA)
	if _, ok := decide(t, s, time.Now(), c); ok {
		t.Errorf("E admitted 0.2s after D with rate 1/s burst 1")
	}
}

// A costly refusal is not cached: a cheap request that fits later is
// admitted, on Redis as in memory.
func TestEdgeRedisCostlyRefusalNotCached(t *testing.T) {
	srv := redistest.StartReal(t, "real")
	lim := Limit{Window: 10 * time.Second, Max: 10, GCRA: true} // 1/s, burst 10
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 2 * time.Second})
	listening(t, s, client)
	s.SetLimits([]Check{{Limit: lim}})
	c := Check{Key: "203.0.113.11", Limit: lim, Cost: 10}
	if _, ok := decide(t, s, time.Now(), c); !ok {
		t.Fatal("first refused")
	}
	if _, ok := decide(t, s, time.Now(), c); ok { // empty bucket, cost 10: a wait of about 10s
		t.Fatal("a costly request admitted by an empty bucket")
	}
	time.Sleep(1100 * time.Millisecond)
	c.Cost = 1
	if _, ok := decide(t, s, time.Now(), c); !ok {
		t.Errorf("a request of cost 1 refused from the cache 1.1s later, though one unit dripped back")
	}
	m := NewMemoryStore(100)
	now := time.Now()
	c.Cost = 10
	decide(t, m, now, c)
	decide(t, m, now, c)
	c.Cost = 1
	if _, ok := decide(t, m, now.Add(1100*time.Millisecond), c); !ok {
		t.Errorf("memory: a request of cost 1 refused 1.1s after a costly refusal")
	}
}
