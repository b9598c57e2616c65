package ratelimit

import (
	"fmt"
	"net/http"
	"net/netip"
	"net/textproto"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// What a limit does when its key resolves empty.
const (
	MissingIP     = "ip"     // count the request under the client IP (the default)
	MissingReject = "reject" // refuse the request with 400: it lacks an identity
)

// Algorithms: how a window is counted.
const (
	AlgorithmFixed   = "fixed"   // fixed windows: up to 2 x max across a window edge
	AlgorithmSliding = "sliding" // sliding-window counter: at most about max in any window
)

// PolicyConfig is one of a handler's policies (named rules, declared by
// "limit <name> <max> <window>" in the Caddyfile) past its first, which
// Window, Max and Key define. A request is admitted only when every policy
// of the handler admits it, and a refused request is counted in none of
// them.
type PolicyConfig struct {
	// Name names the limit in headers, the admin API, metrics and logs:
	// letters, digits, _ and -, at most 32, unique in the handler and other
	// than the zone's name (the name of the first limit).
	Name string `json:"name"`

	// Max is the number of requests admitted per key per window, from 1 to
	// 1000000000.
	Max int `json:"max"`

	// Window is the length of the limit's window, whole seconds from 1s to
	// 366 days; with Calendar, it may be left out.
	Window caddy.Duration `json:"window,omitempty"`

	// MaxInFlight caps the requests of one key of this limit being served
	// at once, as the handler's MaxInFlight does for its first limit (it
	// is not inherited). Default: no cap.
	MaxInFlight int `json:"max_in_flight,omitempty"`

	// Calendar aligns the limit's windows to the calendar in the
	// handler's TimeZone, as the handler's Calendar does for its first
	// limit ("hour", "day", "week" or "month"; Window may then be left
	// out).
	Calendar string `json:"calendar,omitempty"`

	// Key is a placeholder that names what the limit counts, such as
	// "{http.request.header.X-Tenant}". Default: the handler's key.
	Key string `json:"key,omitempty"`

	// Missing says what happens when Key resolves empty: "ip" counts the
	// request under the client IP, "reject" refuses it with 400, and any
	// other value is counted as that key (a canonical identity such as
	// "anonymous"), listed as "missing:" and the value: a bucket of its
	// own that no client's key reaches, and that a ban never touches
	// (its count still refuses). Default: "ip".
	Missing string `json:"missing,omitempty"`

	// BanOff keeps this limit from banning when the handler bans (ban in
	// the Caddyfile's limit block: "ban off"): a limit over a shared key,
	// such as a tenant, whose ban would lock out clients who did nothing.
	// Default: false (the handler's ban applies).
	BanOff bool `json:"ban_off,omitempty"`

	// AbuseControls, where set, replace the handler's in this limit
	// (count_status ["all"] counts every response). Default: the
	// handler's.
	AbuseControls
}

// policy is one limit as a handler runs it.
type policy struct {
	name       string        // as headers, the admin API and metrics show it
	nameAny    any           // name as the placeholder takes it, boxed once
	check      limiter.Check // Slot, Name and Limit; Key is set per request
	key        string        // the key placeholder; "" for the client IP
	keyText    string        // what key resolves to when all its placeholders are empty
	header     string        // the request header key is the placeholder of, canonical; "" for another key
	missing    string        // MissingIP, MissingReject, or a value
	missingKey string        // the stored form of a missing value
	quoted     string        // the name as a quoted string, for the IETF headers
	maxStr     string
	maxAny     any // the max as the limit placeholder takes it, boxed once
	errInvalid error
	// reset is the last reset written for this limit, formatted and boxed:
	// requests of one window, or of windows begun in one second, share it.
	reset *atomic.Pointer[resetText]
	// refusals is the zone's refusal counter for this limit, found at the
	// limit's first refusal (the zone's map is looked up once, not per
	// refused request).
	refusals *atomic.Pointer[atomic.Uint64]

	countStatus []statusRange // responses that count; nil: every one
	costKey     string        // the cost placeholder; "" for the constant check.Cost
	charge      string        // the response header of the charge (canonical); "": none
	chargeLate  string        // charge as an unannounced trailer (http.TrailerPrefix)
	hideCharge  bool          // the charge header is removed from the response
	off         bool          // the request's plan switches the limit off
}

// newPolicy builds a limit as the handler runs it.
func newPolicy(name, storeName string, lim limiter.Limit, key, missing string) policy {
	p := policy{
		name:    name,
		nameAny: name,
		check:   limiter.Check{Name: storeName, Limit: lim},
		missing: missing,
		quoted:  strconv.Quote(name),
		reset:   new(atomic.Pointer[resetText]),

		refusals: new(atomic.Pointer[atomic.Uint64]),
	}
	p.setMax(lim.Max)
	if key != "" && key != "{client_ip}" && key != "{http.vars.client_ip}" {
		p.key = key
		p.keyText = caddy.NewEmptyReplacer().ReplaceAll(key, "")
		p.header = requestHeaderOf(key)
	}
	switch missing {
	case "", MissingIP:
		p.missing = MissingIP
	case MissingReject:
		what := key
		if p.key == "" {
			what = "client IP"
		}
		p.errInvalid = fmt.Errorf("rate limit %q: the request has no %s to count it by", name, what)
	default:
		p.missingKey = missingKeyPrefix + missing // checkMissing kept it short and printable
	}
	return p
}

// resetText is a reset in Unix seconds, as the header and the placeholder
// take it.
type resetText struct {
	sec   int64
	text  string
	boxed any
}

// resetOf returns reset formatted and boxed, from the limit's last one when
// it is the same second.
func (p *policy) resetOf(reset int64) *resetText {
	if r := p.reset.Load(); r != nil && r.sec == reset {
		return r
	}
	r := &resetText{sec: reset, text: strconv.FormatInt(reset, 10), boxed: reset}
	p.reset.Store(r)
	return r
}

// setMax sets the limit's max, and its forms for headers and placeholders.
func (p *policy) setMax(n int) {
	p.check.Limit.Max, p.maxStr, p.maxAny = n, strconv.Itoa(n), n
}

// item is the limit's RateLimit-Policy item.
func (p *policy) item() string {
	return fmt.Sprintf("%s;q=%d;w=%d", p.quoted, p.check.Limit.Max, int64(p.check.Limit.Window/time.Second))
}

// keyHeaderPrefix opens the placeholder of a request header.
const keyHeaderPrefix = "{http.request.header."

// requestHeaderOf returns the canonical name of the request header whose
// placeholder key is, exactly ("{http.request.header.X-Api-Key}"), or "" for
// any other key: one with text or another placeholder around it, or braces
// or escapes inside.
func requestHeaderOf(key string) string {
	name, ok := strings.CutPrefix(key, keyHeaderPrefix)
	if !ok {
		return ""
	}
	name, ok = strings.CutSuffix(name, "}")
	if !ok || name == "" || strings.ContainsAny(name, "{}\\") {
		return ""
	}
	return textproto.CanonicalMIMEHeaderKey(name)
}

// resolve returns the key the request, whose header is h, is counted under
// in this limit, given the client IP key ipKey. It returns "" when the
// request has no key (no client IP), and errInvalid when the limit rejects a
// request without one.
func (p *policy) resolve(repl *caddy.Replacer, h http.Header, ipKey string) (string, error) {
	if p.key != "" {
		var k string
		if p.header != "" {
			// As Caddy's HTTP placeholders resolve it (the values
			// joined with commas), without asking each of the
			// replacer's providers and boxing the value, which cost two
			// allocations a request.
			// A value set with the replacer's Set under the header's
			// placeholder name, which no Caddy module does, is not read.
			k = strings.Join(h[p.header], ",")
		} else {
			k = repl.ReplaceAll(p.key, "")
		}
		// Unknown placeholders resolve empty; a key that resolves to its
		// fixed text alone has no client in it and counts as missing.
		if k != p.keyText {
			return customKey(k), nil
		}
	} else if ipKey != "" {
		return ipKey, nil
	}
	switch p.missing {
	case MissingIP:
		return ipKey, nil
	case MissingReject:
		return "", p.errInvalid
	default:
		return p.missingKey, nil
	}
}

// parsePrefix parses an exempt range: a CIDR, or a single address.
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, err
		}
		// Client IPs are matched in their IPv4 form (exempt unmaps them),
		// so an IPv4-mapped range is too.
		if p.Addr().Is4In6() {
			if p.Bits() < 96 {
				return netip.Prefix{}, fmt.Errorf("an IPv4-mapped range must be /96 or longer")
			}
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// exempt reports whether client IP ip is in an exempt range.
func (rl *RateLimit) exempt(ip string) bool {
	addr, err := netip.ParseAddr(ip)
	if err != nil {
		return false
	}
	addr = addr.Unmap().WithZone("")
	for _, p := range rl.exemptRanges {
		if p.Contains(addr) {
			return true
		}
	}
	return false
}

// constraining returns the index of the verdict that binds the request: of
// the refusing limits, the one whose wait is longest; if none refuses, the
// one with the least quota left (the first of equals).
func constraining(out []limiter.Verdict) int {
	best := 0
	for i := 1; i < len(out); i++ {
		a, b := out[i], out[best]
		switch {
		case !a.Allowed && b.Allowed:
			best = i
		case !a.Allowed && !b.Allowed && a.RetryAfter > b.RetryAfter:
			best = i
		case a.Allowed && b.Allowed && a.Remaining < b.Remaining:
			best = i
		}
	}
	return best
}

// bans reports whether any limit of the handler bans.
func (rl *RateLimit) bans() bool {
	if rl.Ban != 0 {
		return true
	}
	for _, l := range rl.Limits {
		if l.Ban != 0 {
			return true
		}
	}
	return false
}

// abuse returns the limit's abuse controls over the handler's (base): its
// own where it sets them, and no ban with BanOff.
func (l PolicyConfig) abuse(base AbuseControls) AbuseControls {
	a := l.AbuseControls.over(base)
	if l.BanOff {
		a.Ban, a.BanMax = 0, 0
	}
	return a
}

// setAbuse applies a limit's abuse controls, checked already, to p.
func (p *policy) setAbuse(a AbuseControls) {
	p.countStatus, _ = parseStatusRanges("count_status", a.CountStatus)
	p.setCost(string(a.Cost))
	p.charge, p.hideCharge = "", false
	if a.Charge != nil {
		p.setCost(string(a.Charge.Estimate))
		p.charge, p.hideCharge = http.CanonicalHeaderKey(a.Charge.Header), a.Charge.Hide
		p.chargeLate = http.TrailerPrefix + p.charge
	}
	p.check.Limit.Ban, p.check.Limit.BanMax = time.Duration(a.Ban), time.Duration(a.BanMax)
	p.check.Limit.Burst = a.Burst
}
