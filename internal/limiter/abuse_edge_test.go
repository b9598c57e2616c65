package limiter

import (
	"context"
	"testing"
	"time"
)

// GCRA cost*interval overflows int64: a huge cost is admitted and the bucket refilled.
func TestEdgeGCRACostOverflow(t *testing.T) {
	lim := Limit{Window: time.Hour, Max: 100, GCRA: true} // interval 36s
	s := NewMemoryStore(1000)
	c := Check{Key: "k", Limit: lim}
	now := time.Now()
	// drain the bucket
	for i := 0; i < 100; i++ {
		if _, ok := decide(t, s, now, c); !ok {
			t.Fatalf("request %d refused", i)
		}
	}
	if _, ok := decide(t, s, now, c); ok {
		t.Fatal("bucket not empty")
	}
	c.Cost = 1_000_000_000
	out, ok := decide(t, s, now, c)
	t.Logf("cost 1e9: ok=%v %+v", ok, out[0])
	c.Cost = 1
	out, ok = decide(t, s, now, c)
	t.Logf("cost 1 after: ok=%v %+v", ok, out[0])
	if ok {
		t.Errorf("empty bucket admits after a huge-cost request")
	}
}

// GCRA memory verdict Reset is pre-spend.
func TestEdgeGCRAResetPreSpend(t *testing.T) {
	lim := Limit{Window: 10 * time.Second, Max: 10, GCRA: true} // interval 1s
	s := NewMemoryStore(1000)
	c := Check{Key: "k", Limit: lim}
	now := time.Now()
	out, _ := decide(t, s, now, c)
	t.Logf("first: reset-now=%v remaining=%d", out[0].Reset.Sub(now), out[0].Remaining)
	if out[0].Reset.Sub(now) != time.Second {
		t.Errorf("Reset of first admitted GCRA request = now+%v, want now+1s (when the bucket is full again)", out[0].Reset.Sub(now))
	}
}

// GCRA refund after the request's units already dripped back credits an extra unit.
func TestEdgeGCRARefundOverCredit(t *testing.T) {
	lim := Limit{Window: 10 * time.Second, Max: 1, GCRA: true, Burst: 1} // one per 10s
	s := NewMemoryStore(1000)
	c := Check{Key: "k", Limit: lim}
	t0 := time.Now()
	// A: slow, will be refunded (status not counted), decided at t0.
	outA, ok := decide(t, s, t0, c)
	if !ok {
		t.Fatal("A refused")
	}
	// D: counted request at t0+12s (bucket full again), admitted.
	if _, ok := decide(t, s, t0.Add(12*time.Second), c); !ok {
		t.Fatal("D refused")
	}
	// A finishes at t0+15s; its refund.
	s.Refund(context.Background(), []Check{c}, t0.Add(15*time.Second), outA)
	// E at t0+15s: 3s after D, with one per 10s and burst 1: must be refused.
	if _, ok := decide(t, s, t0.Add(15*time.Second), c); ok {
		t.Errorf("E admitted 3s after D with rate 1/10s burst 1 (refund of A credited a unit that had already dripped back)")
	}
}

// escalation: after reaching the cap, the next violation starts over from ban.
func TestEdgeEscalationResets(t *testing.T) {
	lim := Limit{Window: time.Minute, Max: 1, Ban: 4 * time.Hour, BanMax: 24 * time.Hour}
	s := NewMemoryStore(1000)
	c := Check{Key: "k", Limit: lim}
	now := time.Now()
	var bans []time.Duration
	for range 5 {
		// wait out ban and window
		for {
			out, ok := decide(t, s, now, c)
			if ok {
				break
			}
			now = now.Add(out[0].RetryAfter + time.Second)
		}
		out, ok := decide(t, s, now, c)
		if ok {
			t.Fatal("admitted")
		}
		bans = append(bans, out[0].RetryAfter.Round(time.Minute))
	}
	t.Logf("bans: %v", bans)
	// docs: ban 4h escalate 24h: 4, 8, 16, 24, 24 while the offender keeps going
}

// a ban of a day or more never escalates, though the docs say to name a longer max then.
func TestEdgeEscalationDayBan(t *testing.T) {
	lim := Limit{Window: time.Minute, Max: 1, Ban: 24 * time.Hour, BanMax: 7 * 24 * time.Hour}
	s := NewMemoryStore(1000)
	c := Check{Key: "k", Limit: lim}
	now := time.Now()
	var bans []time.Duration
	for range 3 {
		for {
			out, ok := decide(t, s, now, c)
			if ok {
				break
			}
			now = now.Add(out[0].RetryAfter + time.Second)
		}
		out, _ := decide(t, s, now, c)
		bans = append(bans, out[0].RetryAfter.Round(time.Minute))
	}
	t.Logf("bans: %v", bans)
	if bans[1] == bans[0] {
		t.Errorf("ban 24h escalate 168h never escalates: %v", bans)
	}
}
