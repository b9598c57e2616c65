package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// The decision: every limit's key, one atomic verdict of the zone's store
// over all of them, a delay or a refusal, and what a refusal leaves behind
// (the tallies, the log line, the event).

// serve decides the request, whose variables are vars and client IP ip,
// with the buffer d and answers it or passes it on.
func (rl *RateLimit) serve(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, vars map[string]any, ip string) error {
	ctx := r.Context()
	repl := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	ipKey := rl.ipKey(ip)
	checks, of, out := &d.checks, &d.of, &d.out
	pl := rl.planOf(repl, r.Header, vars)
	now := rl.zone.clock.Now()
	if rl.zone.overrides.table.Load() != nil {
		if o := rl.overridePlan(repl, r.Header, ipKey, now); o != nil {
			pl = o
		}
	}
	// Every limit's key first: a limit that rejects a request without its
	// key wins whatever the order; a limit with no key at all (no client
	// IP, missing ip), or one the request's plan switches off, sits this
	// request out.
	n := 0
	for i := range pl.policies {
		p := &pl.policies[i]
		if p.off {
			continue
		}
		key, err := p.resolve(repl, r.Header, ipKey)
		if err != nil {
			rl.zone.count(resultInvalid)
			return caddyhttp.Error(http.StatusBadRequest, err)
		}
		if key == "" {
			continue
		}
		d.n = n + 1 // before the key is written: recycle clears it
		checks[n], of[n] = p.check, i
		checks[n].Key = key
		if key == p.missingKey {
			// The bucket of every request without a key: its count
			// refuses, but a ban would lock out clients it shares.
			checks[n].Limit.Ban, checks[n].Limit.BanMax = 0, 0
		}
		if p.costKey != "" {
			checks[n].Cost = rl.requestCost(p, repl)
			if p.charge != "" {
				checks[n].Cost = max(checks[n].Cost, 1) // an estimate holds 1 at least
			}
			checks[n].Free = checks[n].Cost == 0
		}
		n++
	}
	if n == 0 {
		return next.ServeHTTP(w, r) // nothing to count it by
	}

	if rl.inFlight != nil {
		rl.enterInFlight(d, n)
		defer rl.leaveInFlight(d, n)
	}
	if err := rl.zone.store.Decide(ctx, checks[:n], now, out[:n]); err != nil {
		return rl.undecided(w, r, err)
	}
	allowed := true
	for i := range n {
		allowed = allowed && out[i].Allowed
	}
	delayed := false
	if !allowed && rl.waitRoom != nil && !rl.DryRun {
		var err error
		if allowed, err = rl.delayed(r, d, n, &now); err != nil {
			return rl.undecided(w, r, err)
		}
		delayed = allowed
	}
	if allowed && rl.capsInFlight {
		// The store took a slot of each capped limit: given back when
		// the request ends, however it ends (a panic unwinds through
		// here too).
		rl.zone.flying.Add(1)
		defer rl.releaseSlots(checks[:n])
	}
	if rl.inFlight != nil {
		// Units spent stay counted unless count_status gives them back
		// (serveCounted); a refusal that requests in flight kept from
		// banning waits for them.
		for i := range n {
			d.kept[i] = allowed
		}
		if !allowed {
			rl.pendViolations(d, n)
		}
	}
	m := constraining(out[:n])
	v := out[m]
	key := checks[m].Key
	bp := &pl.policies[of[m]]
	reset := bp.resetOf(ceilSeconds(v.Reset.UnixNano()))
	st := requestVars(vars, repl)
	text := st.headerText()
	rl.setHeaders(w.Header(), text, pl, bp, v, reset, now)
	st.placeholders = placeholders{
		zone:      &rl.policies[0],
		plan:      pl,
		policy:    bp,
		key:       key,
		remaining: v.Remaining,
		reset:     reset,
		exceeded:  !allowed,
	}
	if !allowed {
		st.placeholders.violated = rl.violatedOf(of[:n], out[:n])
		st.placeholders.inFlight = anyInFlight(out[:n])
		rl.refused(checks[:n], of[:n], out[:n], now)
	}
	ws := isWebSocket(r)
	if ws && (allowed || rl.DryRun) {
		return rl.serveWebSocket(w, r, next, st, checks[0].Key, v, allowed)
	}
	switch {
	case delayed && !v.StoreError:
		rl.zone.count(resultDelayed)
	case !allowed && !rl.DryRun && onlyInFlight(out[:n]):
		rl.zone.count(resultInFlight)
	default:
		rl.zone.countVerdict(allowed, v.StoreError, rl.DryRun)
	}
	if allowed && (rl.countStatus || rl.charging) {
		return rl.serveCounted(w, r, next, d, n)
	}
	if allowed || rl.DryRun {
		return next.ServeHTTP(w, r)
	}
	var wait time.Duration
	for i := range n {
		if !out[i].Allowed {
			wait = max(wait, out[i].RetryAfter) // until every refusing limit admits
		}
	}
	st.placeholders.retryAfter = max(ceilSeconds(int64(wait)), 1)
	text.vals[5] = text.number(st.placeholders.retryAfter)
	w.Header()["Retry-After"] = text.vals[5:6:6]
	if ws && rl.refuseWebSocket(w, r) {
		return nil
	}
	if srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok && srv != nil && (srv.Errors == nil || len(srv.Errors.Routes) == 0) {
		// No handle_errors to render the refusal: it is written here, as
		// Caddy would write it (the status, no body), without Caddy's
		// error path (a request clone, a logger clone, error fields) for
		// every refused request of a flood.
		w.WriteHeader(rl.Status)
		return nil
	}
	// The refusal is built once: caddyhttp.Error would draw a random ID and
	// take a stack trace for every refused request of a flood. handle_errors
	// renders it all the same ({http.error.id} is empty).
	return rl.refusal
}

// undecided answers a request the store could not decide: 499 when the
// client went away meanwhile (no fault of the store, and no one to answer;
// it is what Caddy's reverse proxy reports for a closed request), else 503
// with Retry-After, counted as degraded_denied.
func (rl *RateLimit) undecided(w http.ResponseWriter, r *http.Request, err error) error {
	err = fmt.Errorf("rate limit zone %q: %w", rl.Zone, err)
	if r.Context().Err() != nil {
		return caddyhttp.Error(statusClientClosedRequest, err)
	}
	rl.zone.count(resultDegradedDenied)
	w.Header().Set("Retry-After", "1")
	return caddyhttp.Error(http.StatusServiceUnavailable, err)
}

// decision is the scratch space of one request's decision.
type decision struct {
	n      int // the checks in use
	checks [limiter.MaxChecks]limiter.Check
	of     [limiter.MaxChecks]int // the policy of each check
	out    [limiter.MaxChecks]limiter.Verdict
	// refund and refundOut are the checks (and their verdicts) whose
	// units a response outside count_status gives back.
	refund    [limiter.MaxChecks]limiter.Check
	refundOut [limiter.MaxChecks]limiter.Verdict
	// kept marks the checks whose units stayed spent once the request
	// was served (for inFlight).
	kept [limiter.MaxChecks]bool
	// charges are what the response reported (charge), while it is served.
	charges reported
}

// recycle returns d to the pool, holding no request's keys: refund holds
// at most the n checks in use.
func (d *decision) recycle() {
	clear(d.checks[:d.n])
	clear(d.refund[:d.n])
	clear(d.kept[:d.n])
	if d.charges.of != nil { // a limit charged: drop the reported values
		d.charges = reported{}
	}
	d.n = 0
	decisions.Put(d)
}

// decisions recycles decision buffers across requests.
var decisions = sync.Pool{New: func() any { return new(decision) }}

// refused tallies a refusal in each refusing limit, records each refused
// key among the zone's recent offenders (once per request, named with the
// first limit that refused it) and, for a key's first refusal in a window,
// logs it and emits the event.
func (rl *RateLimit) refused(checks []limiter.Check, of []int, out []limiter.Verdict, now time.Time) {
	for i, v := range out {
		if v.Allowed {
			continue
		}
		p := &rl.policies[of[i]]
		c := p.refusals.Load()
		if c == nil {
			c = rl.zone.refusalCounter(p.name)
			p.refusals.Store(c)
		}
		c.Add(1)
		if !refusedEarlier(checks, out, i) {
			rl.zone.offenders.refused(checks[i].Key, p.name, now)
		}
		if v.InFlightFull {
			if c := rl.logger.Check(zapcore.DebugLevel, "requests in flight at their cap"); c != nil {
				c.Write(zap.String("zone", rl.Zone), zap.String("limit", p.name), zap.String("key", checks[i].Key),
					zap.Int("max_in_flight", checks[i].MaxInFlight))
			}
			rl.emitInFlight(p, &checks[i], now)
			continue
		}
		if !v.FirstRefusal {
			continue
		}
		msg := "rate limit exceeded"
		wouldBan := rl.DryRun && v.PendingBan
		switch {
		case wouldBan:
			msg = "rate limit exceeded (dry run: admitted, and not banned)"
			rl.zone.dryRunBans.Add(1)
		case rl.DryRun:
			msg = "rate limit exceeded (dry run: admitted)"
		}
		if c := rl.logger.Check(zapcore.InfoLevel, msg); c != nil {
			fields := []zap.Field{
				zap.String("zone", rl.Zone),
				zap.String("limit", p.name),
				zap.String("key", checks[i].Key),
				zap.Int("max", v.Max),
				zap.Duration("window", p.check.Limit.Window),
				zap.Int64("reset", ceilSeconds(v.Reset.UnixNano())),
			}
			if wouldBan {
				fields = append(fields, zap.Duration("would_ban", p.check.Limit.Ban))
			}
			c.Write(fields...)
		}
		rl.emitExceeded(p, checks[i].Key, v)
	}
}

// refusedEarlier reports whether a check before i refused the request under
// the same key as check i.
func refusedEarlier(checks []limiter.Check, out []limiter.Verdict, i int) bool {
	for j := range i {
		if !out[j].Allowed && checks[j].Key == checks[i].Key {
			return true
		}
	}
	return false
}

// startSharedCut cuts, in the background, the windows of a shared store
// (Redis) that shorter windows end.
func (rl *RateLimit) startSharedCut() {
	if len(rl.cuts) == 0 {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for _, c := range rl.cuts {
			if err := rl.zone.store.CutWindows(ctx, c.check, c.cutoff); err != nil {
				rl.logger.Warn("cutting running windows to the shorter window", zap.String("zone", rl.Zone), zap.String("limit", rl.policies[0].name), zap.Error(err))
			}
		}
	}()
}
