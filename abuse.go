package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// The abuse controls: counting by response status (count_status), bans,
// request cost, and delaying a request instead of refusing it.

// AlgorithmGCRA is the generic cell rate algorithm: max per window as a
// steady rate with bursts of burst.
const AlgorithmGCRA = "gcra"

// CountStatusAll in count_status counts every response, overriding the
// handler's count_status in one limit.
const CountStatusAll = "all"

// DefaultBanMax is the longest escalated ban when "escalate" names none.
const DefaultBanMax = 24 * time.Hour

// Bounds of the delay options.
const (
	MaxDelay           = time.Minute      // the longest delay
	MinDelay           = time.Millisecond // the shortest: below it a delay waits out nothing
	DefaultDelayPerKey = 4                // delay_per_key when unset
	DefaultDelayTotal  = 1000             // delay_total when unset
	MaxDelayWaiting    = 100_000          // the most delay_per_key and delay_total accept
)

// CostValue is a request cost as JSON gives it: a number (10), or a string
// holding a number ("10") or a placeholder ("{http.vars.cost}"). Its value
// is checked with the other settings, so a bad one fails at load.
type CostValue string

// UnmarshalJSON takes a JSON number or string.
func (c *CostValue) UnmarshalJSON(b []byte) error {
	if len(b) > 0 && b[0] != '"' {
		var n json.Number
		if err := json.Unmarshal(b, &n); err != nil {
			return fmt.Errorf("invalid cost %s: must be a number or a string", b)
		}
		*c = CostValue(n)
		return nil
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return err
	}
	*c = CostValue(s)
	return nil
}

// statusRange is one count_status entry: the statuses from lo to hi.
type statusRange struct{ lo, hi int }

// parseStatusRanges parses count_status entries: a code ("401"), a class
// ("4xx") or a range ("500-599"); "all" alone, or none, counts every
// status (nil).
func parseStatusRanges(what string, entries []string) ([]statusRange, error) {
	var out []statusRange
	for _, e := range entries {
		if e == CountStatusAll {
			if len(entries) > 1 {
				return nil, fmt.Errorf("invalid %s %q: all counts every status and stands alone", what, strings.Join(entries, " "))
			}
			return nil, nil
		}
		r, ok := parseStatusRange(e)
		if !ok {
			return nil, fmt.Errorf("invalid %s %q: want a status from %d to %d (401), a class (4xx), a range (500-599) or all; a status below %d is never a response's final one", what, e, MinFinalStatus, MaxStatus, MinFinalStatus)
		}
		out = append(out, r)
	}
	return out, nil
}

// parseStatusRange parses one count_status entry. Every part of it must be
// a final status (200 to 599): an informational one is never recorded, so
// an entry naming one could never match.
func parseStatusRange(e string) (statusRange, bool) {
	code := func(s string) (int, bool) {
		n, err := strconv.Atoi(s)
		return n, err == nil && len(s) == 3 && n >= MinFinalStatus && n <= MaxStatus
	}
	if len(e) == 3 && e[1:] == "xx" && e[0] >= '2' && e[0] <= '5' {
		c := int(e[0]-'0') * 100
		return statusRange{c, c + 99}, true
	}
	if lo, hi, ok := strings.Cut(e, "-"); ok {
		l, ok1 := code(lo)
		h, ok2 := code(hi)
		return statusRange{l, h}, ok1 && ok2 && l <= h
	}
	c, ok := code(e)
	return statusRange{c, c}, ok
}

// counts reports whether a response of status counts in a limit whose
// count_status is ranges (nil: every status counts).
func counts(ranges []statusRange, status int) bool {
	if ranges == nil {
		return true
	}
	for _, r := range ranges {
		if status >= r.lo && status <= r.hi {
			return true
		}
	}
	return false
}

// AbuseControls turn a limit into a brute-force defence. On the handler
// they apply to every limit; on a limit (PolicyConfig) they replace the
// handler's, each where it is set.
type AbuseControls struct {
	// CountStatus, when set, makes only responses with these statuses
	// count against the limit: codes ("401"), classes ("4xx") or ranges
	// ("500-599"); ["all"] counts every response. Every request is still
	// judged first, and a key over its limit is refused before the next
	// handler runs. An admitted request holds its units while it is
	// served and gives them back when its status does not count, so that
	// concurrent requests of one key never overshoot the limit. A
	// WebSocket handshake always counts. Default: every response counts.
	CountStatus []string `json:"count_status,omitempty"`

	// Cost is how many units of the quota a request spends: a whole
	// number from 0 to 1000000000, or a placeholder evaluated per request
	// (a value that is not such a number costs 1, and the first one is
	// logged). A request that costs more than the quota left is refused
	// and spends nothing. A cost of 0 reads the quota without spending
	// it: a route that tells a client what it has left. Default: 1.
	Cost CostValue `json:"cost,omitempty"`

	// Charge makes the limit charge what the response reports the request
	// cost, instead of Cost (which it replaces: set one of them). See
	// ChargeConfig and docs/charges.md. Default: none.
	Charge *ChargeConfig `json:"charge,omitempty"`

	// Ban refuses a key that goes over the limit for this long from its
	// first refusal, not only until its window resets; Retry-After and the
	// quota headers say so. Bans are listed by the admin API
	// (banned_until) and lifted by its unblock; in a Redis zone they hold
	// on every instance. From 1s to 366 days. Default: no ban.
	Ban caddy.Duration `json:"ban,omitempty"`

	// BanMax escalates bans: each violation within a day of the end of the
	// key's previous ban doubles its ban, up to BanMax (above Ban, at most
	// 366 days). Set with Ban: a limit that sets either replaces both.
	// Default: no escalation.
	BanMax caddy.Duration `json:"ban_max,omitempty"`

	// Burst is, with algorithm gcra, how many requests a key with a full
	// bucket may send at once, from 1 to 1000000000. Default: Max.
	Burst int `json:"burst,omitempty"`
}

// over returns a's controls where a sets them, base's elsewhere.
func (a AbuseControls) over(base AbuseControls) AbuseControls {
	if len(a.CountStatus) > 0 {
		base.CountStatus = a.CountStatus
	}
	if a.Cost != "" {
		base.Cost, base.Charge = a.Cost, nil
	}
	if a.Charge != nil {
		base.Cost, base.Charge = "", a.Charge
	}
	if a.Ban != 0 || a.BanMax != 0 {
		base.Ban, base.BanMax = a.Ban, a.BanMax
	}
	if a.Burst != 0 {
		base.Burst = a.Burst
	}
	return base
}

// unmarshalOption parses the Caddyfile option opt into a when it is one of
// the abuse controls, and reports whether it was; what names the limit
// (or "" for the handler) in errors. d is at the option's token.
func (a *AbuseControls) unmarshalOption(d *caddyfile.Dispenser, opt, what string) (bool, error) {
	var err error
	switch opt {
	case "count_status":
		if a.CountStatus = d.RemainingArgs(); len(a.CountStatus) == 0 {
			return true, d.ArgErr()
		}
	case "ban":
		a.Ban, a.BanMax, err = parseBan(d)
	case "charge":
		a.Charge, err = parseCharge(d, join(what, opt))
	case "cost", "burst":
		var val string
		if val, err = oneArg(d, opt); err != nil {
			return true, err
		}
		if opt == "cost" {
			a.Cost = CostValue(val)
		} else {
			a.Burst, err = parseInt(d, join(what, opt), val, 1)
		}
	default:
		return false, nil
	}
	return true, err
}

// join names an option of a limit ("limit \"burst\" cost"), or of the
// handler when what is empty.
func join(what, opt string) string {
	if what == "" {
		return opt
	}
	return what + " " + opt
}

// costOf sets up how a limit's cost is found: a constant, or a placeholder.
func (p *policy) setCost(cost string) {
	p.check.Cost, p.check.Free = 1, false
	if cost == "" {
		return
	}
	if n, err := strconv.Atoi(cost); err == nil {
		p.check.Cost, p.check.Free = n, n == 0
		return
	}
	p.costKey = cost
}

// requestCost returns the cost of the request in this limit. A placeholder
// that does not resolve to a whole number from 0 to MaxRequests (an empty
// one included) costs 1, and the first such value is logged.
func (rl *RateLimit) requestCost(p *policy, repl *caddy.Replacer) int {
	v := repl.ReplaceAll(p.costKey, "")
	n, err := strconv.Atoi(v)
	if err == nil && n >= 0 && n <= MaxRequests {
		return n
	}
	if rl.costWarned.CompareAndSwap(false, true) {
		rl.logger.Warn("request cost is not a whole number from 0 to 1000000000; it costs 1 (logged once per config)",
			zap.String("zone", rl.Zone), zap.String("limit", p.name), zap.String("cost", p.costKey), zap.String("value", printableValue(v)))
	}
	return 1
}

// printableValue returns v for a log line: as it is when printable and
// short, else quoted and cut.
func printableValue(v string) string {
	if len(v) > 64 {
		v = v[:64]
	}
	if printable(v) {
		return v
	}
	return strconv.QuoteToASCII(v)
}

// statusRecorder passes a response through and records its status, for
// count_status, whether the client was still there when it was written,
// and the charges its headers report.
type statusRecorder struct {
	caddyhttp.ResponseWriterWrapper
	ctx     context.Context // the request's: done once the client has gone
	status  int
	gone    bool      // the client had gone when status was written
	charges *reported // the decision's, when a limit charges; else nil
}

// final records the response's final status as its headers go out.
func (w *statusRecorder) final(code int) {
	w.status, w.gone = code, w.ctx.Err() != nil
	if w.charges != nil {
		w.charges.read(w.Header(), false)
	}
}

// WriteHeader records the first final status.
func (w *statusRecorder) WriteHeader(code int) {
	if w.status == 0 && code >= MinFinalStatus {
		w.final(code)
	}
	w.ResponseWriterWrapper.WriteHeader(code)
}

// Write records 200 when the body is written before any status.
func (w *statusRecorder) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.final(http.StatusOK)
	}
	return w.ResponseWriterWrapper.Write(b)
}

// serveCounted serves the admitted request and gives back its units in each
// limit whose count_status the response's status is not in. Only a status
// written while the client was still there decides: a client that goes
// away before its answer (as a brute-forcer that does not wait for a slow
// 401 would) could otherwise spend nothing; a response that writes no
// status counts too. The response is settled when a later handler panics
// as well: reverse_proxy aborts so when a client leaves mid-body.
func (rl *RateLimit) serveCounted(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, n int) (err error) {
	rec := &statusRecorder{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, ctx: r.Context()}
	if rl.charging {
		d.charges = reported{policies: rl.policies, of: d.of[:n]}
		rec.charges = &d.charges
	}
	defer func() { rl.settle(r, rec, err, d, n) }()
	return next.ServeHTTP(rec, r)
}

// settle gives back the units of the request's limits that its response,
// recorded by rec, does not count in (count_status), and charges what it
// reported in the others (charge); err is what the handlers after this
// one returned.
func (rl *RateLimit) settle(r *http.Request, rec *statusRecorder, err error, d *decision, n int) {
	var counted [limiter.MaxChecks]bool
	for i := range n {
		counted[i] = true
	}
	if rl.countStatus {
		rl.settleStatus(r, rec, err, d, n, &counted)
	}
	if rl.charging {
		h := rec.Header()
		rec.charges.read(h, false) // trailers announced before the body
		rec.charges.read(h, true)
		rl.charge(r, rec.charges, d, n, &counted)
	}
}

// settleStatus gives back the units of the limits whose count_status the
// response's status is not in, and clears their counted.
func (rl *RateLimit) settleStatus(r *http.Request, rec *statusRecorder, err error, d *decision, n int, counted *[limiter.MaxChecks]bool) {
	status := rec.status
	decides := status != 0 && !rec.gone
	if status == 0 && err != nil && r.Context().Err() == nil {
		// Nothing written yet: the error handler writes the response
		// later, and its status is the error's.
		status, decides = http.StatusInternalServerError, true
		var he caddyhttp.HandlerError
		if errors.As(err, &he) && he.StatusCode != 0 {
			status = he.StatusCode
		}
	}
	if !decides {
		return
	}
	k := 0
	for i := range n {
		if !counts(rl.policies[d.of[i]].countStatus, status) {
			d.refund[k], d.refundOut[k] = d.checks[i], d.out[i]
			d.kept[i], counted[i] = false, false
			k++
		}
	}
	if k > 0 {
		if rerr := rl.zone.store.Refund(r.Context(), d.refund[:k], rl.zone.clock.Now(), d.refundOut[:k]); rerr != nil {
			rl.logger.Warn("giving back a request that does not count", zap.String("zone", rl.Zone), zap.Error(rerr))
		}
	}
}

// waitRoom bounds the requests a handler keeps waiting (delay): at most
// perKey per key and total in all.
type waitRoom struct {
	mu     sync.Mutex
	byKey  map[string]int
	total  int
	perKey int
	cap    int
}

// enter takes a place for key and reports whether there was one.
func (wr *waitRoom) enter(key string) bool {
	wr.mu.Lock()
	defer wr.mu.Unlock()
	if wr.total >= wr.cap || wr.byKey[key] >= wr.perKey {
		return false
	}
	wr.total++
	wr.byKey[key]++
	return true
}

// leave gives back key's place.
func (wr *waitRoom) leave(key string) {
	wr.mu.Lock()
	defer wr.mu.Unlock()
	wr.total--
	if wr.byKey[key]--; wr.byKey[key] <= 0 {
		delete(wr.byKey, key)
	}
}

// delayed makes a refused request wait, when every refusing limit admits
// again within the delay and the wait room has a place for its key, then
// decides it again at *now, which it moves to the new decision's time. It
// reports whether the request is now admitted; out holds the new verdicts.
// A client that goes away while waiting spends nothing (errClientGone).
func (rl *RateLimit) delayed(r *http.Request, d *decision, n int, now *time.Time) (bool, error) {
	var wait time.Duration
	for i := range n {
		if !d.out[i].Allowed {
			wait = max(wait, d.out[i].RetryAfter)
		}
	}
	if wait > time.Duration(rl.Delay) {
		return false, nil
	}
	key := d.checks[constraining(d.out[:n])].Key
	if !rl.waitRoom.enter(key) {
		return false, nil
	}
	defer rl.waitRoom.leave(key)
	// A little past the wait: Redis gives it in whole milliseconds,
	// rounded down, and waking a moment early refuses the request anew.
	t := rl.zone.clock.NewTimer(wait + 2*time.Millisecond)
	select {
	case <-r.Context().Done():
		t.Stop()
		return false, errClientGone
	case <-t.C():
	}
	*now = rl.zone.clock.Now()
	if err := rl.zone.store.Decide(r.Context(), d.checks[:n], *now, d.out[:n]); err != nil {
		return false, err
	}
	for i := range n {
		if !d.out[i].Allowed {
			return false, nil
		}
	}
	return true, nil
}

// errClientGone is a delayed request whose client went away.
var errClientGone = errors.New("the client went away while its request was delayed")

// shared describes the abuse controls that handlers naming one zone must
// share (those the store keeps: bans and the bucket's size), "" when none
// is set.
func (a AbuseControls) shared() string {
	out := ""
	if a.Ban != 0 {
		out += fmt.Sprintf(" ban=%s", time.Duration(a.Ban))
		if a.BanMax != 0 {
			out += fmt.Sprintf(" ban_max=%s", time.Duration(a.BanMax))
		}
	}
	if a.Burst != 0 {
		out += fmt.Sprintf(" burst=%d", a.Burst)
	}
	return out
}

// inFlight tracks, per limit and key, the requests being served under a
// limit that both counts by status and bans, and the violation pending on
// them. A refusal while other requests of the key are in flight may come
// from units they hold and will give back (count_status), so it starts no
// ban at once (limiter.Check.NoBan): it is pending. When the last of them
// settles, the violation stands if any of them stayed counted and lapses
// if every one gave its units back; if they are still in flight when the
// refusing window ends, it stands then. A violation that stands bans the
// key from that moment. The tracking is per handler and process: on Redis
// the ban is written after the fact, and then holds on every instance.
type inFlight struct {
	mu      sync.Mutex
	flights map[string]*flight  // by limit name and key
	ban     func(limiter.Check) // starts the ban of a violation that stands
	clock   clock.Clock         // the zone's
}

// flight is the requests in flight of one key in one limit.
type flight struct {
	n       int
	pending *violation // nil: none
}

// violation is a refusal whose ban waits for the requests in flight.
type violation struct {
	check   limiter.Check // the refusing limit and key
	counted bool          // a request in flight settled counted since
	timer   clock.Timer   // the refusing window's end: the violation stands
}

// flightKey is the key of limit name and client key in inFlight.flights.
func flightKey(name, key string) string { return name + "\x00" + key }

// enter records one more request of key in limit name and returns how many
// are in flight, this one included.
func (f *inFlight) enter(name, key string) int {
	k := flightKey(name, key)
	f.mu.Lock()
	defer f.mu.Unlock()
	fl := f.flights[k]
	if fl == nil {
		fl = new(flight)
		f.flights[k] = fl
	}
	fl.n++
	return fl.n
}

// violate records a violation of c's limit by c.Key, a request in flight
// itself, pending until the key's requests settle or end, the end of the
// refusing window. A violation already pending stands for both.
func (f *inFlight) violate(name string, c limiter.Check, end time.Time) {
	k := flightKey(name, c.Key)
	f.mu.Lock()
	defer f.mu.Unlock()
	fl := f.flights[k]
	if fl == nil || fl.pending != nil {
		return
	}
	v := &violation{check: c}
	v.timer = f.clock.AfterFunc(end.Sub(f.clock.Now()), func() { f.expire(k, v) })
	fl.pending = v
}

// leave records the end of a request of key in limit name, which stayed
// counted or not, and starts the ban of a pending violation that stands
// once the last request of the key settles.
func (f *inFlight) leave(name, key string, counted bool) {
	k := flightKey(name, key)
	f.mu.Lock()
	fl := f.flights[k]
	fl.n--
	v := fl.pending
	if v != nil && counted {
		v.counted = true
	}
	if fl.n > 0 {
		f.mu.Unlock()
		return
	}
	delete(f.flights, k)
	f.mu.Unlock()
	if v != nil {
		v.timer.Stop()
		if v.counted {
			f.ban(v.check)
		}
	}
}

// expire makes violation v of the flight at k stand: its window ended with
// requests of the key still in flight.
func (f *inFlight) expire(k string, v *violation) {
	f.mu.Lock()
	fl := f.flights[k]
	if fl == nil || fl.pending != v {
		f.mu.Unlock()
		return // settled meanwhile
	}
	fl.pending = nil
	f.mu.Unlock()
	f.ban(v.check)
}

// holdsBan reports whether p both counts by status and bans.
func (p *policy) holdsBan() bool {
	return p.countStatus != nil && p.check.Limit.Ban > 0
}

// inFlightTracked reports whether check i of d is tracked in flight: its
// policy counts by status, and the check bans (a missing bucket's never
// does).
func (rl *RateLimit) inFlightTracked(d *decision, i int) bool {
	return rl.policies[d.of[i]].countStatus != nil && d.checks[i].Limit.Ban > 0
}

// enterInFlight records the request in every limit it is tracked in
// flight in, marking NoBan on the checks of a key with other requests in
// flight.
func (rl *RateLimit) enterInFlight(d *decision, n int) {
	for i := range n {
		if rl.inFlightTracked(d, i) && rl.inFlight.enter(rl.policies[d.of[i]].name, d.checks[i].Key) > 1 {
			d.checks[i].NoBan = true
		}
	}
}

// pendViolations makes each refusal of d that a request in flight kept from
// banning a pending violation.
func (rl *RateLimit) pendViolations(d *decision, n int) {
	for i := range n {
		if d.out[i].PendingBan && rl.inFlightTracked(d, i) {
			rl.inFlight.violate(rl.policies[d.of[i]].name, d.checks[i], d.out[i].Reset)
		}
	}
}

// leaveInFlight records the end of the request in every limit it entered,
// counted where its units stayed spent.
func (rl *RateLimit) leaveInFlight(d *decision, n int) {
	for i := range n {
		if rl.inFlightTracked(d, i) {
			rl.inFlight.leave(rl.policies[d.of[i]].name, d.checks[i].Key, d.kept[i])
		}
	}
}

// startBan bans the key of a violation that stood once the requests in
// flight settled.
func (rl *RateLimit) startBan(c limiter.Check) {
	c.NoBan = false
	name := c.Name
	if name == "" {
		name = rl.Zone // the first limit is named after the zone
	}
	until, err := rl.zone.store.Ban(context.Background(), c, rl.zone.clock.Now())
	if err != nil {
		rl.logger.Warn("starting the ban of a violation that stood once the key's requests settled",
			zap.String("zone", rl.Zone), zap.String("limit", name), zap.String("key", c.Key), zap.Error(err))
		return
	}
	if ce := rl.logger.Check(zapcore.InfoLevel, "rate limit ban started: the key's requests in flight settled counted"); ce != nil && !until.IsZero() {
		ce.Write(zap.String("zone", rl.Zone), zap.String("limit", name), zap.String("key", c.Key), zap.Int64("banned_until", ceilSeconds(until.UnixNano())))
	}
}
