package limiter

import (
	"context"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// The sync store takes a lease per capped check after an admitting
// decision: past the cap it refuses, and gives back what the table had
// counted; a release frees the slot; with Redis gone, on_error local caps
// this process's requests instead.
func TestSyncStoreInFlight(t *testing.T) {
	srv := redistest.Start(t)
	s, _ := newTestSyncStore(t, []string{srv.Addr}, RedisStoreOptions{Sync: 100 * time.Millisecond})
	ctx := context.Background()
	checks := func() []Check {
		return []Check{{Key: "k", Limit: Limit{Window: time.Minute, Max: 100}, MaxInFlight: 1}}
	}
	decide := func(c []Check) Verdict {
		out := make([]Verdict, 1)
		if err := s.Decide(ctx, c, time.Now(), out); err != nil {
			t.Fatal(err)
		}
		return out[0]
	}
	first := checks()
	if v := decide(first); !v.Allowed || first[0].Lease == "" || v.Remaining != 99 {
		t.Fatalf("the first: %+v, lease %q; want admitted with a lease", v, first[0].Lease)
	}
	second := checks()
	if v := decide(second); v.Allowed || !v.InFlightFull || v.RetryAfter != time.Second || second[0].Lease != "" {
		t.Fatalf("a second in flight: %+v, lease %q; want refused for the requests in flight", v, second[0].Lease)
	}
	_ = s.Release(ctx, first)
	var v Verdict
	waitUntil(t, srv, time.Now(), time.Now().Add(time.Second), "the released slot", func() bool {
		c := checks()
		v = decide(c)
		if v.Allowed {
			_ = s.Release(ctx, c)
		}
		return v.Allowed
	})
	// The refused second spent nothing: 2 admitted so far.
	if v.Remaining != 98 {
		t.Errorf("remaining %d after two admitted and one refused, want 98", v.Remaining)
	}
	srv.Stop()
	local := checks()
	if v := decide(local); !v.Allowed || local[0].Lease != localLease || !v.StoreError {
		t.Fatalf("with Redis gone: %+v, lease %q; want admitted on a slot of this process", v, local[0].Lease)
	}
	if v := decide(checks()); v.Allowed || !v.InFlightFull {
		t.Fatalf("a second with Redis gone: %+v, want refused by this process's count", v)
	}
	_ = s.Release(ctx, local)
	if v := decide(checks()); !v.Allowed {
		t.Fatalf("after the local release: %+v, want admitted", v)
	}
}
