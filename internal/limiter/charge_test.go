package limiter

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// spent returns what s counts for key in the window running at now; -1
// when the key is not tracked.
func spent(t *testing.T, s Store, key string, now time.Time) int {
	t.Helper()
	n := -1
	err := s.Range(context.Background(), now, func(k KeyState) bool {
		if k.Key == key {
			n = k.Count
			return false
		}
		return true
	})
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// chargeAndSee charges c's key by cost after the decision out, and waits
// until s counts want for it (a Redis store charges off the caller's path).
func chargeAndSee(t *testing.T, s Store, c Check, out []Verdict, cost, want int) {
	t.Helper()
	c.Cost = cost
	if err := s.Charge(context.Background(), []Check{c}, time.Now(), out); err != nil {
		t.Fatal(err)
	}
	if got := spentSoon(t, s, c.Key, want); got != want {
		t.Fatalf("after a charge of %d: %d spent, want %d", cost, got, want)
	}
}

// spentSoon polls what s counts for key until it is want (a Redis store
// charges off the caller's path), for up to 5s, and returns the last count.
func spentSoon(t *testing.T, s Store, key string, want int) int {
	t.Helper()
	got := spent(t, s, key, time.Now())
	for deadline := time.Now().Add(5 * time.Second); got != want && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
		got = spent(t, s, key, time.Now())
	}
	return got
}

// A charge spends what the response reported whatever is left, past max
// if it must, starts no ban, and gives back as a refund when negative.
func TestCharge(t *testing.T) {
	fixed := Limit{Window: time.Minute, Max: 10, Ban: time.Minute}
	sliding := Limit{Window: time.Minute, Max: 10, Algorithm: SlidingWindow}
	for name, lim := range map[string]Limit{"fixed": fixed, "sliding": sliding} {
		t.Run(name, func(t *testing.T) {
			forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
				c := Check{Key: "203.0.113.9", Limit: lim, NoBan: true}
				out, ok := decide(t, s, time.Now(), c)
				if !ok || out[0].Remaining != 9 {
					t.Fatalf("first request = %+v, want admitted with 9 left", out[0])
				}
				chargeAndSee(t, s, c, out, 7, 8)
				if out, ok = decide(t, s, time.Now(), c); !ok || out[0].Remaining != 1 {
					t.Fatalf("after a charge of 7: %+v, want admitted with 1 left", out[0])
				}
				chargeAndSee(t, s, c, out, -3, 6)
				chargeAndSee(t, s, c, out, 10, 16)
				if refused, ok := decide(t, s, time.Now(), c); ok || refused[0].Remaining != 0 || refused[0].RetryAfter <= 0 {
					t.Fatalf("past max by a charge: %+v, want refused with 0 left", refused[0])
				}
				// Neither the charge past max nor that refusal (NoBan)
				// started a ban: given back below max, the key is admitted.
				chargeAndSee(t, s, c, out, -8, 8)
				c.NoBan = false
				if again, ok := decide(t, s, time.Now(), c); !ok || again[0].Remaining != 1 {
					t.Fatalf("given back to 8 of 10: %+v, want admitted with 1 left", again[0])
				}
			})
		})
	}
}

// A refused decision is charged nothing, whatever its response reported:
// charged beside an admitted one in one call, only the admitted one lands.
func TestChargeRefused(t *testing.T) {
	lim := Limit{Window: time.Minute, Max: 1}
	forEachStore(t, []Check{{Limit: lim}}, func(t *testing.T, s Store) {
		c := Check{Key: "203.0.113.10", Limit: lim}
		admitted, _ := decide(t, s, time.Now(), c)
		refused, ok := decide(t, s, time.Now(), c)
		if ok {
			t.Fatal("second request of max 1 admitted")
		}
		refusedCharge, admittedCharge := c, c
		refusedCharge.Cost, admittedCharge.Cost = 5, 2
		checks := []Check{refusedCharge, admittedCharge}
		if err := s.Charge(context.Background(), checks, time.Now(), []Verdict{refused[0], admitted[0]}); err != nil {
			t.Fatal(err)
		}
		if got := spentSoon(t, s, c.Key, 3); got != 3 {
			t.Fatalf("after charges of 5 (refused) and 2 (admitted) on 1 spent: %d, want 3", got)
		}
	})
}

// Sync mode counts a charge in its table and sends it at the next round.
func TestRedisSyncCharge(t *testing.T) {
	srv := redistest.Start(t)
	limit := Limit{Window: time.Minute, Max: 10}
	for _, spend := range []string{SyncShare, SyncAll} {
		t.Run(spend, func(t *testing.T) {
			// One instance: a second that has not seen the key would
			// have the round hold its first spare share for it (see
			// redis_sync.lua), which is not what this test is about.
			fleet := manualFleet(t, srv, 1, RedisStoreOptions{SyncSpend: spend, Clock: alignedClock(limit.Window), Prefix: "test:" + t.Name() + ":"})
			a := fleet[0]
			c := Check{Key: "203.0.113.11", Limit: limit}
			out, ok := decide(t, a, a.clock.Now(), c)
			if !ok {
				t.Fatal("first request refused")
			}
			c.Cost = 6
			if err := a.Charge(context.Background(), []Check{c}, a.clock.Now(), out); err != nil {
				t.Fatal(err)
			}
			round(fleet...)
			if n := count(t, a, c.Key); n != 7 {
				t.Fatalf("Redis holds %d after a charge of 6 on 1 spent, want 7", n)
			}
			c.Cost = 0
			if out, ok := decide(t, a, a.clock.Now(), c); !ok || out[0].Remaining != 2 {
				t.Fatalf("after the charge was sent: %+v, want admitted with 2 left", out[0])
			}
		})
	}
}
