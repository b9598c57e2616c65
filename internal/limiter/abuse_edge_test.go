package limiter

import (
	"context"
	"slices"
	"testing"
	"time"
)

// A cost whose units times the interval overflow int64 is refused, and
// leaves the empty bucket empty.
func TestEdgeGCRACostOverflow(t *testing.T) {
	lim := Limit{Window: time.Hour, Max: 100, Algorithm: GCRA} // interval 36s
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
	if _, ok := decide(t, s, now, c); ok {
		t.Errorf("a cost of 1e9 admitted by an empty bucket")
	}
	c.Cost = 1
	if _, ok := decide(t, s, now, c); ok {
		t.Errorf("empty bucket admits after a huge-cost request")
	}
}

// An admitted GCRA request's Reset is when the bucket is full again after
// it, not before.
func TestEdgeGCRAResetAfterSpend(t *testing.T) {
	lim := Limit{Window: 10 * time.Second, Max: 10, Algorithm: GCRA} // interval 1s
	s := NewMemoryStore(1000)
	c := Check{Key: "k", Limit: lim}
	now := time.Now()
	out, _ := decide(t, s, now, c)
	if out[0].Reset.Sub(now) != time.Second {
		t.Errorf("Reset of first admitted GCRA request = now+%v, want now+1s (when the bucket is full again)", out[0].Reset.Sub(now))
	}
}

// A GCRA refund after the request's units have dripped back credits no
// extra unit.
func TestEdgeGCRARefundOverCredit(t *testing.T) {
	lim := Limit{Window: 10 * time.Second, Max: 1, Algorithm: GCRA, Burst: 1} // one per 10s
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

// Escalation doubles each ban up to the longest and stays there while the
// offender keeps going; a ban of a day or more escalates too when a longer
// longest is named (docs/abuse-controls.md, Escalation).
func TestEdgeEscalation(t *testing.T) {
	for _, tc := range []struct {
		ban, longest time.Duration
		want         []time.Duration
	}{
		{4 * time.Hour, 24 * time.Hour, []time.Duration{4 * time.Hour, 8 * time.Hour, 16 * time.Hour, 24 * time.Hour, 24 * time.Hour}},
		{24 * time.Hour, 7 * 24 * time.Hour, []time.Duration{24 * time.Hour, 48 * time.Hour, 96 * time.Hour}},
	} {
		s := NewMemoryStore(1000)
		c := Check{Key: "k", Limit: Limit{Window: time.Minute, Max: 1, Ban: tc.ban, BanMax: tc.longest}}
		now := time.Now()
		var bans []time.Duration
		for range tc.want {
			for { // wait out the ban and the window
				out, ok := decide(t, s, now, c)
				if ok {
					break
				}
				now = now.Add(out[0].RetryAfter + time.Second)
			}
			out, ok := decide(t, s, now, c) // the violation
			if ok {
				t.Fatalf("ban %v: a second request in the window admitted with max 1", tc.ban)
			}
			bans = append(bans, out[0].RetryAfter.Round(time.Minute))
		}
		if !slices.Equal(bans, tc.want) {
			t.Errorf("ban %v escalate %v: bans %v, want %v", tc.ban, tc.longest, bans, tc.want)
		}
	}
}
