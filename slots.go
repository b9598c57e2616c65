package ratelimit

import (
	"context"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// Requests in flight (max_in_flight): a capped limit's store takes one of
// the key's slots with the decision that admits a request, and the
// handler gives it back when the request ends. (Not the inFlight of
// abuse.go, which holds the requests awaiting a count_status verdict.)

// releaseSlots gives back the slots the admitted decision over checks
// took.
func (rl *RateLimit) releaseSlots(checks []limiter.Check) {
	_ = rl.zone.store.Release(context.Background(), checks) // a memory store's never fails
	rl.zone.flying.Add(-1)
}

// onlyInFlight reports whether every refusing verdict of out refused for
// the key's requests in flight alone.
func onlyInFlight(out []limiter.Verdict) bool {
	for i := range out {
		if !out[i].Allowed && !out[i].InFlightFull {
			return false
		}
	}
	return true
}

// anyInFlight reports whether a verdict of out refused for the key's
// requests in flight.
func anyInFlight(out []limiter.Verdict) bool {
	for i := range out {
		if out[i].InFlightFull {
			return true
		}
	}
	return false
}
