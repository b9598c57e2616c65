package limiter

import (
	"context"
	"testing"
	"time"
)

// A key's requests in flight are capped per limit: past the cap a request
// is refused with a second to wait, spends nothing in any limit and is no
// violation; a release frees a slot at once, and the listing shows them.
func TestMemoryInFlight(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(100)
	s.SetSlotName(1, "hourly")
	now := time.Now()
	lim := Limit{Window: time.Minute, Max: 100, Ban: time.Hour}
	checks := []Check{{Key: "k", Limit: lim, MaxInFlight: 2}, {Slot: 1, Name: "hourly", Key: "k", Limit: Limit{Window: time.Hour, Max: 100}}}
	decide := func() []Verdict {
		out := make([]Verdict, 2)
		if err := s.Decide(context.Background(), checks, now, out); err != nil {
			t.Fatal(err)
		}
		return out
	}
	for i := range 2 {
		if v := decide(); !v[0].Allowed || !v[1].Allowed {
			t.Fatalf("request %d: %+v, want admitted", i, v)
		}
	}
	v := decide()
	if v[0].Allowed || !v[0].InFlightFull || v[0].RetryAfter != time.Second || v[0].FirstRefusal || v[0].PendingBan || v[1].Allowed != true {
		t.Fatalf("a third in flight: %+v, want refused for the requests in flight, no violation", v)
	}
	if v[0].Remaining != 98 || v[1].Remaining != 98 {
		t.Errorf("remaining %d and %d after the refusal, want 98 each: it spent nothing", v[0].Remaining, v[1].Remaining)
	}
	listed := func() int {
		n := 0
		_ = s.Range(context.Background(), now, func(ks KeyState) bool {
			if ks.Name == "" {
				n = ks.InFlight
			}
			return true
		})
		return n
	}
	if n := listed(); n != 2 {
		t.Errorf("listed in flight %d, want 2", n)
	}
	_ = s.Release(context.Background(), checks)
	if v := decide(); !v[0].Allowed {
		t.Fatalf("after a release: %+v, want admitted", v)
	}
	_ = s.Release(context.Background(), checks)
	_ = s.Release(context.Background(), checks)
	if n := listed(); n != 0 {
		t.Errorf("listed in flight %d after every release, want 0", n)
	}
	if len(s.shards[s.hash("k", 0)&s.mask].flying[0]) != 0 {
		t.Error("a key with nothing in flight is still kept")
	}
}
