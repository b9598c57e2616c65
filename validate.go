package ratelimit

import (
	"cmp"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// Validation: every setting of the handler and its limits checked in one
// place, each error naming the option and its value. The Caddyfile parser
// checks only the shape of the tokens, and for a value written in a form
// JSON has not (windowS's seconds, maxTracked as the user spelled it) asks
// this file's rule for it; Provision and the Caddyfile adapter call check.

// check reports every invalid setting, naming the option and its value.
func (rl *RateLimit) check() error {
	var errs []error
	if rl.Max < 0 || rl.Max > MaxRequests {
		errs = append(errs, fmt.Errorf("invalid max %d: must be from 1 to %d", rl.Max, MaxRequests))
	}
	if rl.Window != 0 { // 0: the default
		if err := checkWindow("window", time.Duration(rl.Window)); err != nil {
			errs = append(errs, err)
		}
	}
	if !validZoneName(rl.Zone) {
		errs = append(errs, fmt.Errorf("invalid zone %q: use letters, digits and _ - . : only", rl.Zone))
	} else if rl.Zone == dashboardZone {
		errs = append(errs, fmt.Errorf("invalid zone %q: the name is the admin dashboard's (/rate_limit/%s)", rl.Zone, dashboardZone))
	}
	if err := checkKey("key", rl.Key); err != nil {
		errs = append(errs, err)
	}
	if rl.MaxTracked != 0 {
		if err := maxTrackedRule(rl.MaxTracked); err != nil {
			errs = append(errs, fmt.Errorf("invalid max_tracked %d: %w", rl.MaxTracked, err))
		}
	}
	if rl.IPv6Prefix < 0 || rl.IPv6Prefix > MaxIPv6Prefix {
		errs = append(errs, fmt.Errorf("invalid ipv6_prefix %d: must be between 1 and %d", rl.IPv6Prefix, MaxIPv6Prefix))
	}
	switch rl.Headers {
	case "", HeadersLegacy, HeadersIETF, HeadersBoth, HeadersNone:
	default:
		errs = append(errs, fmt.Errorf("invalid headers %q: must be legacy, ietf, both or none", rl.Headers))
	}
	if g := time.Duration(rl.GCInterval); g < 0 || (g > 0 && g < MinGCInterval) {
		errs = append(errs, fmt.Errorf("invalid gc_interval %s: must be at least %s", g, MinGCInterval))
	}
	if d := time.Duration(rl.WSLeaseTTL); d != 0 && (d < MinWSLeaseTTL || d > MaxWSLeaseTTL) {
		errs = append(errs, fmt.Errorf("invalid ws_lease_ttl %s: must be from %s to %s", d, humanDuration(MinWSLeaseTTL), humanDuration(MaxWSLeaseTTL)))
	}
	if rl.WSMaxConnectionsPerIP < 0 {
		errs = append(errs, fmt.Errorf("invalid ws_max_connections_per_ip %d: must be at least 1, or 0 for no cap", rl.WSMaxConnectionsPerIP))
	}
	switch rl.WSReject {
	case "", WSRejectClose, WSRejectStatus:
	default:
		errs = append(errs, fmt.Errorf("invalid ws_reject %q: must be close or status", rl.WSReject))
	}
	if err := rl.Store.check(); err != nil {
		errs = append(errs, err)
	}
	errs = append(errs, rl.checkLimits()...)
	errs = append(errs, rl.checkPlans()...)
	errs = append(errs, rl.checkCalendars()...)
	errs = append(errs, rl.checkInFlight()...)
	return errors.Join(errs...)
}

// maxTrackedRule says why n is no max_tracked, or nil.
func maxTrackedRule(n int) error {
	if n < MinMaxTracked {
		return fmt.Errorf("must be at least %d", MinMaxTracked)
	}
	return nil
}

// windowSecondsRule says why a window of secs whole seconds (too many for
// an int64 when overflow) is none, or nil: the form windowS and a bare
// window take.
func windowSecondsRule(secs int64, overflow bool) error {
	switch {
	case secs < 1:
		return errors.New("must be at least 1 second")
	case overflow || secs > int64(MaxWindow/MinWindow):
		return fmt.Errorf("must be at most %d seconds (%s)", int64(MaxWindow/MinWindow), MaxWindow)
	}
	return nil
}

// validZoneName reports whether name is a usable zone name: it appears in
// header values, admin API paths and Redis keys, so it is kept to a plain
// token, and never a dot segment. "" is valid (the default zone).
func validZoneName(name string) bool {
	if name == "." || name == ".." {
		return false
	}
	for _, c := range name {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '-', c == '.', c == ':':
		default:
			return false
		}
	}
	return true
}

// checkKey checks a key placeholder ("" is the client IP): well-formed, and
// naming something of the request.
func checkKey(what, key string) error {
	if n, err := countPlaceholders(key); err != nil {
		return fmt.Errorf("invalid %s %q: %v", what, key, err)
	} else if key != "" && n == 0 {
		return fmt.Errorf("invalid %s %q: must hold a placeholder such as {http.request.header.X-API-Key}, or every client would share one counter", what, key)
	}
	return nil
}

// countPlaceholders counts the placeholders in s and reports a malformed
// one: a { with no } before the next { or the end, a } with no {, or an
// empty {}. Caddy's replacer leaves such text as it is, so a key with a typo
// would never name the client. A backslash escapes a brace, as it does for
// the replacer: an escaped brace opens or closes nothing.
func countPlaceholders(s string) (int, error) {
	n, open := 0, -1
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '\\':
			if i+1 < len(s) && (s[i+1] == '{' || s[i+1] == '}') {
				i++
			}
		case '{':
			if open >= 0 {
				return n, fmt.Errorf("placeholder at offset %d is not closed with }", open)
			}
			open = i
		case '}':
			switch open {
			case -1:
				return n, fmt.Errorf("} at offset %d closes no placeholder (escape it as \\})", i)
			case i - 1:
				return n, fmt.Errorf("empty placeholder {} at offset %d", open)
			}
			open = -1
			n++
		}
	}
	if open >= 0 {
		return n, fmt.Errorf("placeholder at offset %d is not closed with }", open)
	}
	return n, nil
}

// checkLimits reports every invalid limit setting, naming the option and
// its value.
func (rl *RateLimit) checkLimits() []error {
	var errs []error
	if err := checkMissing("missing", rl.Missing); err != nil {
		errs = append(errs, err)
	}
	if len(rl.Limits)+1 > limiter.MaxChecks {
		errs = append(errs, fmt.Errorf("invalid limit: %d limits (the handler's first and %d more), at most %d", len(rl.Limits)+1, len(rl.Limits), limiter.MaxChecks))
	}
	seen := map[string]bool{}
	for _, l := range rl.Limits {
		what := fmt.Sprintf("limit %q", l.Name)
		if !validLimitName(l.Name) {
			errs = append(errs, fmt.Errorf("invalid limit name %q: use 1 to %d letters, digits, _ and - only", l.Name, MaxLimitName))
		}
		zone := rl.Zone
		if zone == "" {
			zone = DefaultZone
		}
		if l.Name == zone {
			errs = append(errs, fmt.Errorf("invalid limit name %q: the zone's name is its first limit's", l.Name))
		}
		if seen[l.Name] {
			errs = append(errs, fmt.Errorf("invalid limit name %q: given twice", l.Name))
		}
		seen[l.Name] = true
		if l.Max < 1 || l.Max > MaxRequests {
			errs = append(errs, fmt.Errorf("invalid %s max %d: must be from 1 to %d", what, l.Max, MaxRequests))
		}
		if err := checkWindow(what+" window", cmp.Or(time.Duration(l.Window), calendarWindow(l.Calendar))); err != nil {
			errs = append(errs, err)
		}
		if err := checkKey(what+" key", l.Key); err != nil {
			errs = append(errs, err)
		}
		if err := checkMissing(what+" missing", l.Missing); err != nil {
			errs = append(errs, err)
		}
		errs = append(errs, l.AbuseControls.check(what, rl.Algorithm)...)
		if l.BanOff && (l.Ban != 0 || l.BanMax != 0) {
			errs = append(errs, fmt.Errorf("invalid %s ban %s: the limit sets ban_off (ban off) too", what, time.Duration(l.Ban)))
		}
	}
	errs = append(errs, rl.AbuseControls.check("", rl.Algorithm)...)
	errs = append(errs, rl.checkSync()...)
	if rl.Algorithm == AlgorithmGCRA {
		if err := checkBucket("", rl.Max, time.Duration(rl.Window), rl.Burst); err != nil {
			errs = append(errs, err)
		}
		for _, l := range rl.Limits {
			if err := checkBucket(fmt.Sprintf("limit %q ", l.Name), l.Max, time.Duration(l.Window), cmp.Or(l.Burst, rl.Burst)); err != nil {
				errs = append(errs, err)
			}
		}
	}
	if d := time.Duration(rl.Delay); d < 0 || d > MaxDelay || (d > 0 && d < MinDelay) {
		errs = append(errs, fmt.Errorf("invalid delay %s: must be from %s to %s", d, MinDelay, MaxDelay))
	}
	if rl.DelayPerKey < 0 || rl.DelayPerKey > MaxDelayWaiting {
		errs = append(errs, fmt.Errorf("invalid delay_per_key %d: must be from 1 to %d", rl.DelayPerKey, MaxDelayWaiting))
	}
	if rl.DelayTotal < 0 || rl.DelayTotal > MaxDelayWaiting {
		errs = append(errs, fmt.Errorf("invalid delay_total %d: must be from 1 to %d", rl.DelayTotal, MaxDelayWaiting))
	}
	if rl.Delay == 0 && (rl.DelayPerKey != 0 || rl.DelayTotal != 0) {
		errs = append(errs, fmt.Errorf("invalid delay_per_key %d / delay_total %d: they bound delay, which is not set", rl.DelayPerKey, rl.DelayTotal))
	}
	if rl.Delay != 0 && rl.bans() {
		errs = append(errs, fmt.Errorf("invalid delay %s: a handler that bans cannot delay (the refusal a delay would wait out starts a ban)", time.Duration(rl.Delay)))
	}
	switch rl.Algorithm {
	case "", AlgorithmFixed, AlgorithmSliding, AlgorithmGCRA:
	default:
		errs = append(errs, fmt.Errorf("invalid algorithm %q: must be fixed, sliding or gcra", rl.Algorithm))
	}
	if rl.Status != 0 && (rl.Status < MinStatus || rl.Status > MaxStatus) {
		errs = append(errs, fmt.Errorf("invalid status %d: must be from %d to %d", rl.Status, MinStatus, MaxStatus))
	}
	for _, e := range rl.Exempt {
		if _, err := parsePrefix(e); err != nil {
			errs = append(errs, fmt.Errorf("invalid exempt %q: %v", e, err))
		}
	}
	return errs
}

// MaxInFlightCap bounds max_in_flight.
const MaxInFlightCap = 1_000_000

// checkMaxInFlight checks a max_in_flight: 0 for none, else from 1 to
// MaxInFlightCap.
func checkMaxInFlight(what string, n int) error {
	if n < 0 || n > MaxInFlightCap {
		return fmt.Errorf("invalid %s %d: must be from 1 to %d", what, n, MaxInFlightCap)
	}
	return nil
}

// checkInFlight reports every invalid max_in_flight of the handler and
// its limits (a plan's are checked with the plan).
func (rl *RateLimit) checkInFlight() []error {
	var errs []error
	if err := checkMaxInFlight("max_in_flight", rl.MaxInFlight); err != nil {
		errs = append(errs, err)
	}
	for _, l := range rl.Limits {
		if err := checkMaxInFlight(fmt.Sprintf("limit %q max_in_flight", l.Name), l.MaxInFlight); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}

// hasInFlightCap reports whether a limit of the handler, or of one of its
// plans, caps requests in flight.
func (rl *RateLimit) hasInFlightCap() bool {
	capped := rl.MaxInFlight != 0
	for _, l := range rl.Limits {
		capped = capped || l.MaxInFlight != 0
	}
	for _, pc := range rl.Plans {
		capped = capped || pc.MaxInFlight != 0
		for _, pl := range pc.Limits {
			capped = capped || pl.MaxInFlight != 0
		}
	}
	return capped
}

// checkMissing checks a missing setting: ip, reject, or a canonical value,
// which must be printable and short enough to be kept as it is.
func checkMissing(what, v string) error {
	switch {
	case v == "", v == MissingIP, v == MissingReject:
		return nil
	case !printable(v) || len(v) > maxCustomKeyLen || strings.ContainsAny(v, "{}"):
		return fmt.Errorf("invalid %s %q: a value must be printable text of at most %d bytes, without braces", what, v, maxCustomKeyLen)
	}
	return nil
}

// checkWindow checks a window length.
func checkWindow(what string, w time.Duration) error {
	switch {
	case w < MinWindow:
		return fmt.Errorf("invalid %s %s: must be at least %s (a bare number in JSON is nanoseconds; write \"60s\")", what, w, MinWindow)
	case w > MaxWindow:
		return fmt.Errorf("invalid %s %s: must be at most %s", what, w, MaxWindow)
	case w%MinWindow != 0:
		return fmt.Errorf("invalid %s %s: must be a whole number of seconds", what, w)
	}
	return nil
}

// validLimitName reports whether name can name a limit: it appears in
// headers, Redis keys, metric labels and admin URLs.
func validLimitName(name string) bool {
	if name == "" || len(name) > MaxLimitName {
		return false
	}
	for _, c := range name {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// checkSync reports what a Redis store's sync mode cannot do with the
// handler's limits: GCRA (a bucket's arrival time has no per-instance
// count to add up), and a window not at least two intervals long.
func (rl *RateLimit) checkSync() []error {
	if !rl.Store.isRedis() || rl.Store.Sync == 0 {
		return nil
	}
	interval := time.Duration(rl.Store.Sync)
	var errs []error
	if rl.Algorithm == AlgorithmGCRA {
		errs = append(errs, fmt.Errorf("invalid algorithm %q with sync %s: a GCRA bucket is one arrival time, which instances cannot count apart and add up; use fixed or sliding", rl.Algorithm, interval))
	}
	check := func(what string, w time.Duration) {
		if w != 0 && w < 2*interval {
			errs = append(errs, fmt.Errorf("invalid %s %s with sync %s: a window must be at least two sync intervals", what, w, interval))
		}
	}
	check("window", time.Duration(rl.Window))
	for _, l := range rl.Limits {
		check(fmt.Sprintf("limit %q window", l.Name), time.Duration(l.Window))
	}
	return errs
}

// checkBucket checks that a GCRA bucket of burst requests (0: max), one
// every window/max, empties within MaxWindow: a deeper one could not be
// kept as a time.
func checkBucket(what string, max int, window time.Duration, burst int) error {
	if max < 1 || window <= 0 {
		return nil // reported elsewhere, or the defaults
	}
	b := cmp.Or(burst, max)
	if interval := window / time.Duration(max); interval > 0 && time.Duration(b) > MaxWindow/interval {
		return fmt.Errorf("invalid %sburst %d: %d requests, one every %s, take longer than %s to drip back", what, b, b, interval, MaxWindow)
	}
	return nil
}

// checkCost checks a cost: a whole number from 0 to MaxRequests, or a
// placeholder evaluated per request.
func checkCost(what, v string) error {
	if v == "" {
		return nil
	}
	if strings.Contains(v, "{") {
		return checkKey(what, v)
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 || n > MaxRequests {
		return fmt.Errorf("invalid %s %q: must be a whole number from 0 to %d, or a placeholder", what, v, MaxRequests)
	}
	return nil
}

// checkCharge checks a charge (named what): a response header's name, no
// placeholder (a client could set it), an estimate a cost of at least 1,
// and no cost beside it.
func (a AbuseControls) checkCharge(what, algorithm string) []error {
	var errs []error
	c := a.Charge
	switch {
	case strings.Contains(c.Header, "{"):
		errs = append(errs, fmt.Errorf("invalid %s %q: name a response header, not a placeholder (a client may control one)", what, c.Header))
	case !validFieldName(c.Header):
		errs = append(errs, fmt.Errorf("invalid %s %q: must be a response header's name", what, c.Header))
	}
	if a.Cost != "" {
		errs = append(errs, fmt.Errorf("invalid %s %q beside cost %q: a limit's cost is fixed or charged by the response, set one", what, c.Header, a.Cost))
	}
	if algorithm == AlgorithmGCRA {
		errs = append(errs, fmt.Errorf("invalid %s %q: algorithm gcra does not charge by the response; use fixed or sliding", what, c.Header))
	}
	if err := checkCost(what+" estimate", string(c.Estimate)); err != nil {
		errs = append(errs, err)
	} else if n, err := strconv.Atoi(string(c.Estimate)); err == nil && n == 0 {
		errs = append(errs, fmt.Errorf("invalid %s estimate %q: must be at least 1 (a key is admitted while it has the estimate left)", what, c.Estimate))
	}
	return errs
}

// validFieldName reports whether name is an HTTP header field name: one
// or more token characters (RFC 9110, section 5.1).
func validFieldName(name string) bool {
	if name == "" {
		return false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c >= 0x80 || !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return true
}

// checkBan checks a ban and its escalation cap.
func checkBan(what string, ban, banMax time.Duration) error {
	switch {
	case ban == 0 && banMax != 0:
		return fmt.Errorf("invalid %s_max %s: escalation needs a ban", what, banMax)
	case ban == 0:
		return nil
	case ban < MinWindow || ban > MaxWindow:
		return fmt.Errorf("invalid %s %s: must be from %s to %s", what, ban, MinWindow, MaxWindow)
	case banMax != 0 && (banMax <= ban || banMax > MaxWindow):
		return fmt.Errorf("invalid %s_max %s: the longest escalated ban must be above the ban (%s) and at most %s", what, banMax, ban, MaxWindow)
	}
	return nil
}

// check reports every invalid control, naming the option (of the limit
// what names, or of the handler for "") and its value.
func (a AbuseControls) check(what, algorithm string) []error {
	var errs []error
	if _, err := parseStatusRanges(join(what, "count_status"), a.CountStatus); err != nil {
		errs = append(errs, err)
	}
	if err := checkCost(join(what, "cost"), string(a.Cost)); err != nil {
		errs = append(errs, err)
	}
	if err := checkBan(join(what, "ban"), time.Duration(a.Ban), time.Duration(a.BanMax)); err != nil {
		errs = append(errs, err)
	}
	if a.Charge != nil {
		errs = append(errs, a.checkCharge(join(what, "charge"), algorithm)...)
	}
	if a.Burst != 0 {
		if algorithm != AlgorithmGCRA {
			errs = append(errs, fmt.Errorf("invalid %s %d: burst applies to algorithm gcra only", join(what, "burst"), a.Burst))
		} else if a.Burst < 1 || a.Burst > MaxRequests {
			errs = append(errs, fmt.Errorf("invalid %s %d: must be from 1 to %d", join(what, "burst"), a.Burst, MaxRequests))
		}
	}
	return errs
}
