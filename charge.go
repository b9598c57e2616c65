package ratelimit

import (
	"net/http"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// ChargeConfig makes a limit charge what the response reports a request
// cost (tokens a model used, rows an export wrote) instead of a cost fixed
// on arrival. An admitted request holds its estimate while it is served;
// when the response ends, the difference between the reported charge and
// the estimate is spent (past max if it must be) or given back, so the
// next request of the key sees what is left. A key is admitted while it
// has the estimate left.
type ChargeConfig struct {
	// Header names the response header whose value is the request's
	// charge: a whole number from 0 to 1000000000. When the response has
	// no such header, the trailer of that name is read when the response
	// ends (a streamed answer that reports its usage last). A missing or
	// invalid value charges the estimate; the first is logged, and each is
	// counted in caddy_rate_limit_invalid_charges_total. Required; only a
	// name, never a placeholder: the value must be the upstream's, not the
	// client's.
	Header string `json:"header"`

	// Estimate is what an admitted request holds until its response
	// reports its charge: a whole number from 1 to 1000000000, or a
	// placeholder (a value that is not such a number holds 1). Default: 1.
	Estimate CostValue `json:"estimate,omitempty"`

	// Hide removes the header (and the trailer) from the response before
	// it reaches the client.
	Hide bool `json:"hide,omitempty"`
}

// Reasons a response's charge was not taken, as the result label of the
// invalid charges metric.
const (
	chargeMissing = iota // no header, no trailer
	chargeInvalid        // not a whole number from 0 to MaxRequests
	numChargeFaults
)

// chargeFaultNames are the result label values, indexed by fault.
var chargeFaultNames = [numChargeFaults]string{"missing", "invalid"}

// reported holds, per check of a decision, the charge value its response
// reported, read once: from the headers when the status is written, else
// from the trailers when the response ends.
type reported struct {
	policies []policy
	of       []int // the policy of each check
	vals     [limiter.MaxChecks]string
	found    [limiter.MaxChecks]bool
}

// read takes the values of the charge headers in h not read yet, and
// removes the hidden ones: as headers (or trailers announced before the
// body), or with late as trailers that were not (http.TrailerPrefix).
func (c *reported) read(h http.Header, late bool) {
	for i, o := range c.of {
		p := &c.policies[o]
		if p.charge == "" || (c.found[i] && !p.hideCharge) {
			continue
		}
		name := p.charge
		if late {
			name = p.chargeLate
		}
		if vv, ok := h[name]; ok && !c.found[i] {
			c.found[i] = true
			if len(vv) > 0 {
				c.vals[i] = vv[0]
			}
		}
		if p.hideCharge {
			delete(h, name)
		}
	}
}

// charge spends, or gives back, the difference between what the response
// reported each charging limit cost and what the request held, in the
// checks that still count (counted).
func (rl *RateLimit) charge(r *http.Request, rep *reported, d *decision, n int, counted *[limiter.MaxChecks]bool) {
	k := 0
	for i := range n {
		p := &rl.policies[d.of[i]]
		if p.charge == "" || !counted[i] {
			continue
		}
		held := d.checks[i].Cost
		units, ok := rl.chargeOf(p, rep.vals[i], rep.found[i])
		if !ok {
			units = held
		}
		rl.zone.charged.Add(uint64(units))
		if units != held {
			d.refund[k], d.refundOut[k] = d.checks[i], d.out[i]
			d.refund[k].Cost = units - held
			k++
		}
	}
	if k == 0 {
		return
	}
	if err := rl.zone.store.Charge(r.Context(), d.refund[:k], rl.zone.clock.Now(), d.refundOut[:k]); err != nil {
		rl.logger.Warn("charging what a response reported", zap.String("zone", rl.Zone), zap.Error(err))
	}
}

// chargeOf returns the charge a response reported for p: v, when found and
// a whole number from 0 to MaxRequests. Otherwise it counts the fault and
// logs the first of the config.
func (rl *RateLimit) chargeOf(p *policy, v string, found bool) (int, bool) {
	fault := chargeMissing
	if found {
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err == nil && n >= 0 && n <= MaxRequests {
			return n, true
		}
		fault = chargeInvalid
	}
	rl.zone.chargeFaults[fault].Add(1)
	if rl.chargeWarned.CompareAndSwap(false, true) {
		rl.logger.Warn("response charge is missing or not a whole number from 0 to 1000000000; the estimate stands (logged once per config)",
			zap.String("zone", rl.Zone), zap.String("limit", p.name), zap.String("header", p.charge),
			zap.String("reason", chargeFaultNames[fault]), zap.String("value", printableValue(v)))
	}
	return 0, false
}
