package limiter

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// The abuse controls (cost, refunds, bans, GCRA) on every store: the same
// test runs on the memory store, a real redis-server and a Redis Cluster.
// GCRA in Redis reads Redis's clock, so these tests use the real time.

// forEachStore runs fn on a memory store, a Redis store and, unless short, a
// Redis Cluster store, each with the limits a zone would give it.
func forEachStore(t *testing.T, limits []Check, fn func(t *testing.T, s Store)) {
	t.Run("memory", func(t *testing.T) {
		t.Parallel()
		s := NewMemoryStore(1000)
		for _, c := range limits {
			s.SetSlotName(c.Slot, c.Name)
		}
		fn(t, s)
	})
	t.Run("redis", func(t *testing.T) {
		t.Parallel()
		srv := redistest.Start(t)
		storeServers.Store(t, srv)
		t.Cleanup(func() { storeServers.Delete(t) })
		s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 2 * time.Second})
		s.SetLimits(limits)
		fn(t, s)
	})
}

// storeServers are the Redis servers of forEachStore's running tests.
var storeServers sync.Map // *testing.T → *redistest.Server

// wait lets d pass for the store of forEachStore's test t: on its Redis
// server's clock too, which an in-process server (no redis-server
// installed) moves only when told.
func wait(t *testing.T, d time.Duration) {
	if srv, ok := storeServers.Load(t); ok {
		srv.(*redistest.Server).Sleep(d)
		return
	}
	time.Sleep(d)
}

func TestCost(t *testing.T) {
	lim := Limit{Window: time.Minute, Max: 10}
	forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
		now := time.Now()
		c := Check{Key: "203.0.113.1", Limit: lim, Cost: 4}
		for i, want := range []int{6, 2} {
			out, ok := decide(t, s, now, c)
			if !ok || out[0].Remaining != want {
				t.Fatalf("request %d of cost 4 = %+v, want admitted with %d left", i+1, out[0], want)
			}
		}
		// 4 more than the 2 left: refused, and it spends nothing.
		out, ok := decide(t, s, now, c)
		if ok || out[0].Remaining != 2 || out[0].RetryAfter <= 0 {
			t.Fatalf("third request of cost 4 = %+v, want refused with 2 left", out[0])
		}
		c.Cost = 2
		if out, ok := decide(t, s, now, c); !ok || out[0].Remaining != 0 {
			t.Fatalf("a request of cost 2 with 2 left = %+v, want admitted with 0 left", out[0])
		}
		c.Cost = 1
		if _, ok := decide(t, s, now, c); ok {
			t.Fatal("a request of cost 1 with nothing left was admitted")
		}
	})
}

func TestRefund(t *testing.T) {
	fixed := Limit{Window: time.Minute, Max: 2}
	gcra := Limit{Window: time.Minute, Max: 2, Algorithm: GCRA}
	limits := []Check{{Limit: fixed}, {Slot: 1, Name: "bucket", Limit: gcra}}
	forEachStore(t, limits, func(t *testing.T, s Store) {
		checks := []Check{
			{Key: "203.0.113.2", Limit: fixed},
			{Slot: 1, Name: "bucket", Key: "203.0.113.2", Limit: gcra},
		}
		// Each admitted request is given back: the quota never runs out.
		for i := range 5 {
			decided := time.Now()
			out, ok := decide(t, s, decided, checks...)
			if !ok || out[0].Remaining != 1 || out[1].Remaining != 1 {
				t.Fatalf("request %d = %+v, want admitted with 1 left in each limit", i+1, out)
			}
			if err := s.Refund(context.Background(), checks, decided, out); err != nil {
				t.Fatal(err)
			}
		}
		// Without refunds, it does.
		for range 2 {
			decide(t, s, time.Now(), checks...)
		}
		if out, ok := decide(t, s, time.Now(), checks...); ok {
			t.Fatalf("third request without refunds = %+v, want refused", out)
		}
	})
}

// A ban outlives the window: a 200ms window, so that waiting it out takes
// no more than 300ms, under a 3s ban.
func TestBan(t *testing.T) {
	lim := Limit{Window: 200 * time.Millisecond, Max: 1, Ban: 3 * time.Second}
	forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
		c := Check{Key: "203.0.113.3", Limit: lim}
		start := time.Now()
		if _, ok := decide(t, s, start, c); !ok {
			t.Fatal("first request refused")
		}
		out, ok := decide(t, s, time.Now(), c)
		if ok || out[0].RetryAfter < 2500*time.Millisecond || out[0].Remaining != 0 || out[0].Reset.Sub(start) < 2500*time.Millisecond {
			t.Fatalf("second request = %+v, want refused for the 3s ban", out[0])
		}
		// The window ended long ago; the ban holds.
		wait(t, 300*time.Millisecond)
		out, ok = decide(t, s, time.Now(), c)
		if ok || out[0].RetryAfter < 2*time.Second {
			t.Fatalf("request after the window = %+v, want still banned", out[0])
		}
		var banned []KeyState
		if err := s.Range(context.Background(), time.Now(), func(ks KeyState) bool {
			banned = append(banned, ks)
			return true
		}); err != nil {
			t.Fatal(err)
		}
		if len(banned) != 1 || banned[0].Key != c.Key || banned[0].BannedUntil.Sub(start) < 2500*time.Millisecond {
			t.Fatalf("listing = %+v, want the key, banned for 3s", banned)
		}
		// Forgetting the key lifts its ban.
		if ok, err := s.ForgetCheck(context.Background(), c); err != nil || !ok {
			t.Fatalf("ForgetCheck = %t, %v", ok, err)
		}
		if out, ok := decide(t, s, time.Now(), c); !ok {
			t.Fatalf("request after the unblock = %+v, want admitted", out[0])
		}
	})
}

// Bans double with each strike up to BanMax: in milliseconds, so that
// waiting out three bans takes 1.2s, not 6s.
func TestBanEscalates(t *testing.T) {
	const ban = 200 * time.Millisecond
	lim := Limit{Window: ban / 2, Max: 1, Ban: ban, BanMax: 3 * ban}
	if got := []time.Duration{lim.banFor(1), lim.banFor(2), lim.banFor(3), lim.banFor(60)}; got[0] != ban || got[1] != 2*ban || got[2] != 3*ban || got[3] != 3*ban {
		t.Fatalf("bans of strikes 1, 2, 3, 60 = %v, want %v %v %v %v", got, ban, 2*ban, 3*ban, 3*ban)
	}
	forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
		c := Check{Key: "203.0.113.4", Limit: lim}
		var bans []time.Duration
		for range 3 {
			// Wait out the ban and the window, spend the quota, go over.
			for {
				out, ok := decide(t, s, time.Now(), c)
				if ok {
					break
				}
				wait(t, out[0].RetryAfter+20*time.Millisecond)
			}
			out, ok := decide(t, s, time.Now(), c)
			if ok {
				t.Fatal("second request in a window admitted")
			}
			bans = append(bans, out[0].RetryAfter)
		}
		// 1, 2, then 3 bans (the cap): each its ban, less the time the
		// decision took.
		for i, want := range []time.Duration{ban, 2 * ban, 3 * ban} {
			if bans[i] < want-ban/2 || bans[i] > want+ban/4 {
				t.Fatalf("bans = %v, want about %v, %v, %v", bans, ban, 2*ban, 3*ban)
			}
		}
	})
}

func TestGCRA(t *testing.T) {
	// 10 per second: one every 100ms, bursts of 3.
	lim := Limit{Window: time.Second, Max: 10, Algorithm: GCRA, Burst: 3}
	forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
		c := Check{Key: "203.0.113.5", Limit: lim}
		for i, want := range []int{2, 1, 0} {
			out, ok := decide(t, s, time.Now(), c)
			if !ok || out[0].Remaining != want {
				t.Fatalf("burst request %d = %+v, want admitted with %d left", i+1, out[0], want)
			}
		}
		out, ok := decide(t, s, time.Now(), c)
		if ok || out[0].RetryAfter <= 0 || out[0].RetryAfter > 100*time.Millisecond {
			t.Fatalf("request past the burst = %+v, want refused for at most one interval", out[0])
		}
		// One interval later, one request, not two.
		wait(t, out[0].RetryAfter+10*time.Millisecond)
		if out, ok := decide(t, s, time.Now(), c); !ok {
			t.Fatalf("request an interval later = %+v, want admitted", out[0])
		}
		if out, ok := decide(t, s, time.Now(), c); ok {
			t.Fatalf("second request an interval later = %+v, want refused", out[0])
		}
		// A cost above the burst never fits.
		c.Cost = 4
		if out, ok := decide(t, s, time.Now().Add(time.Second), c); ok {
			t.Fatalf("request of cost 4 over a burst of 3 = %+v, want refused", out[0])
		}
	})
}

// A costly request that does not fit is no violation: it starts no ban, and
// a cheaper request still passes. A NoBan refusal starts none either.
func TestBanNotForCostOrNoBan(t *testing.T) {
	lim := Limit{Window: time.Minute, Max: 10, Ban: time.Minute}
	forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
		c := Check{Key: "203.0.113.6", Limit: lim, Cost: 8}
		if _, ok := decide(t, s, time.Now(), c); !ok {
			t.Fatal("first request of cost 8 refused")
		}
		if out, ok := decide(t, s, time.Now(), c); ok || out[0].RetryAfter > time.Minute {
			t.Fatalf("second request of cost 8 = %+v, want refused, not banned", out[0])
		}
		c.Cost = 2
		if out, ok := decide(t, s, time.Now(), c); !ok {
			t.Fatalf("request of cost 2 with 2 left = %+v, want admitted (no ban)", out[0])
		}
		c.Cost, c.NoBan = 1, true
		decide(t, s, time.Now(), c) // refused, in flight elsewhere: no ban
		c.NoBan = false
		var banned int
		_ = s.Range(context.Background(), time.Now(), func(ks KeyState) bool {
			if !ks.BannedUntil.IsZero() {
				banned++
			}
			return true
		})
		if banned != 0 {
			t.Fatalf("%d keys banned, want none", banned)
		}
		// Now a violation: a request of one unit refused by the count.
		if out, ok := decide(t, s, time.Now(), c); ok || out[0].RetryAfter < 59*time.Second {
			t.Fatalf("request of one unit with none left = %+v, want banned for a minute", out[0])
		}
	})
}

// A NoBan refusal that would have banned says so (PendingBan); a costly
// request's refusal, no violation, does not. Ban then bans the key from
// the moment it is called, and escalates as the refusal's own ban would.
func TestPendingBanThenBan(t *testing.T) {
	lim := Limit{Window: time.Minute, Max: 3, Ban: time.Minute, BanMax: time.Hour}
	forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
		c := Check{Key: "203.0.113.7", Limit: lim, NoBan: true}
		for range 2 {
			if _, ok := decide(t, s, time.Now(), c); !ok {
				t.Fatal("a request within max refused")
			}
		}
		c.Cost = 2
		if out, ok := decide(t, s, time.Now(), c); ok || out[0].PendingBan {
			t.Fatalf("a refused request of cost 2 with 1 left = %+v, want refused and no pending ban (no violation)", out[0])
		}
		c.Cost = 1
		if _, ok := decide(t, s, time.Now(), c); !ok {
			t.Fatal("the third request refused")
		}
		out, ok := decide(t, s, time.Now(), c)
		if ok || !out[0].PendingBan || out[0].RetryAfter > time.Minute {
			t.Fatalf("a NoBan violation = %+v, want refused by the window with a pending ban", out[0])
		}
		c.NoBan = false
		until, err := s.Ban(context.Background(), c, time.Now())
		if err != nil || time.Until(until) < 59*time.Second || time.Until(until) > time.Minute {
			t.Fatalf("Ban = %v, %v; want a minute from now", until, err)
		}
		c.NoBan = true // a running ban refuses all the same
		if out, ok := decide(t, s, time.Now(), c); ok || out[0].PendingBan || out[0].RetryAfter < 59*time.Second {
			t.Fatalf("a request of a banned key = %+v, want refused by the ban, nothing pending", out[0])
		}
		// The second violation within a day doubles the ban.
		c.NoBan = false
		if until, err := s.Ban(context.Background(), c, time.Now()); err != nil || time.Until(until) < 119*time.Second {
			t.Fatalf("second Ban = %v, %v; want two minutes from now", until, err)
		}
		var bannedUntil time.Time
		_ = s.Range(context.Background(), time.Now(), func(ks KeyState) bool {
			if ks.Key == c.Key {
				bannedUntil = ks.BannedUntil
			}
			return true
		})
		if time.Until(bannedUntil) < 119*time.Second {
			t.Fatalf("listed banned until %v, want two minutes from now", bannedUntil)
		}
	})
}
