package ratelimit

import (
	"net/http"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// The response: the quota headers and the {http.rate_limit.*} placeholders
// of a decided request.

// placeholders are one request's {http.rate_limit.*} values. The replacer
// asks for them only when a placeholder is used: setting seven values in its
// map for every request (a lock and a map write each, two values boxed) cost
// more than the decision. The zone's name, the plan's, the limit's name and
// max and the reset are read from where they are kept boxed, once per limit
// or plan.
type placeholders struct {
	zone       *policy // the zone's first limit, named after the zone
	plan       *plan
	policy     *policy // the limit that binds the request
	reset      *resetText
	key        string
	remaining  int
	retryAfter int64 // Retry-After's seconds on a refusal; 0 otherwise
	exceeded   bool
	inFlight   bool          // refused for the key's requests in flight (max_in_flight)
	violated   *violatedText // the limits that refused; nil when none did
}

// violatedText names the limits that refused a request, as the
// placeholders give them: "api,hourly" and ["api","hourly"]. Limit names
// are letters, digits and _ - . : (a zone's name), so they need no
// escaping in JSON.
type violatedText struct {
	list, json any // boxed once
}

// noneViolated is violatedText for an admitted request.
var noneViolated = &violatedText{list: "", json: "[]"}

// violatedOf returns the text naming the limits whose verdicts in out
// refused (of gives each verdict's policy), built once per set of limits.
func (rl *RateLimit) violatedOf(of []int, out []limiter.Verdict) *violatedText {
	var mask uint32
	for i := range out {
		if !out[i].Allowed {
			mask |= 1 << of[i]
		}
	}
	if v, ok := rl.violated.Load(mask); ok {
		return v.(*violatedText)
	}
	var names []string
	for i := range rl.policies {
		if mask&(1<<i) != 0 {
			names = append(names, rl.policies[i].name)
		}
	}
	v := &violatedText{list: strings.Join(names, ","), json: `["` + strings.Join(names, `","`) + `"]`}
	rl.violated.Store(mask, v)
	return v
}

// requestState is what the handler keeps for one request: its placeholders
// and, in the same allocation, the first handler's quota header values.
type requestState struct {
	placeholders
	text     headerText
	textUsed bool // text holds a handler's values: a second handler takes its own
}

// headerText holds one response's quota header values: the header map's
// value slices are cut from vals, and the values computed per request are
// written into buf, after the n bytes in use. Bytes in use are never
// written again, so the strings that point into buf stay as they were.
type headerText struct {
	vals [6]string // the legacy three, RateLimit-Policy, RateLimit, Retry-After
	n    int
	buf  [48]byte // the request's state stays within 256 bytes (TestRequestStateSizeClass)
}

// number returns v's digits, written into buf when they fit there (else
// on the heap).
func (t *headerText) number(v int64) string {
	return t.keep(strconv.AppendInt(t.buf[t.n:t.n], v, 10))
}

// keep returns b, appended to the unused part of buf, as a string, and
// marks its bytes in use when they are buf's (an append past buf's end
// copied them to the heap).
func (t *headerText) keep(b []byte) string {
	if len(b) <= len(t.buf)-t.n {
		t.n += len(b)
	}
	return unsafe.String(unsafe.SliceData(b), len(b))
}

// headerText returns the header values for this handler: the ones kept
// with the state the first time, a fresh one for a second handler on the
// same request (its values would otherwise change the first one's strings).
func (st *requestState) headerText() *headerText {
	if st.textUsed {
		return new(headerText)
	}
	st.textUsed = true
	return &st.text
}

// placeholdersKey names the request's state in its variables (a plain map,
// cheaper to ask than the replacer), where a second rate_limit handler on
// the same request finds it and overwrites the placeholders, so that the
// last handler's values show, as they would if each handler set them. No
// placeholder or matcher can name it: the NUL byte.
const placeholdersKey = "rate_limit\x00placeholders"

// requestVars returns the request's state, given its variables (nil
// outside Caddy's server, in an embedding that has none: the replacer
// keeps it then), registering its placeholders with the replacer on the
// first call.
func requestVars(vars map[string]any, repl *caddy.Replacer) *requestState {
	var found any
	if vars != nil {
		found = vars[placeholdersKey]
	} else {
		found, _ = repl.Get(placeholdersKey)
	}
	if st, ok := found.(*requestState); ok {
		return st
	}
	st := new(requestState)
	if vars != nil {
		vars[placeholdersKey] = st
	} else {
		repl.Set(placeholdersKey, st)
	}
	repl.Map(st.replace)
	return st
}

// replace is the placeholders' caddy.ReplacerFunc.
func (p *placeholders) replace(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, "http.rate_limit.")
	if !ok {
		return nil, false
	}
	switch name {
	case "zone":
		return p.zone.nameAny, true
	case "plan":
		return p.plan.name, true
	case "policy":
		return p.policy.nameAny, true
	case "key":
		return p.key, true
	case "limit":
		return p.policy.maxAny, true
	case "remaining":
		return p.remaining, true
	case "reset":
		return p.reset.boxed, true
	case "exceeded":
		return p.exceeded, true
	case "in_flight":
		return p.inFlight, true
	case "retry_after":
		return p.retryAfter, true
	case "violated":
		return p.violatedText().list, true
	case "violated_json":
		return p.violatedText().json, true
	}
	return nil, false
}

// violatedText returns the text of the limits that refused the request.
func (p *placeholders) violatedText() *violatedText {
	if p.violated == nil {
		return noneViolated
	}
	return p.violated
}

// setHeaders sets the quota headers of the configured mode for the limit
// that binds the request (p of plan pl, whose verdict is v), with their
// values in t; reset is v.Reset in Unix seconds, rounded up.
// RateLimit-Policy lists every limit of the plan.
func (rl *RateLimit) setHeaders(h http.Header, t *headerText, pl *plan, p *policy, v limiter.Verdict, reset *resetText, now time.Time) {
	if !rl.legacyHeaders && !rl.ietfHeaders {
		return
	}
	// Canonical keys set directly: h.Set would allocate to canonicalize
	// them on every request. They go out as X-Ratelimit-*, as h.Set would
	// send them; header names are case-insensitive. Each value slice is
	// capped to its own element of t.vals, so that appending to one
	// copies it rather than overwrite the next.
	remaining := t.number(int64(v.Remaining))
	if rl.legacyHeaders {
		t.vals[0], t.vals[1], t.vals[2] = p.maxStr, remaining, reset.text
		h["X-Ratelimit-Limit"] = t.vals[0:1:1]
		h["X-Ratelimit-Remaining"] = t.vals[1:2:2]
		h["X-Ratelimit-Reset"] = t.vals[2:3:3]
	}
	if rl.ietfHeaders {
		left := max(ceilSeconds(int64(v.Reset.Sub(now))), 0)
		// Written after remaining's digits in buf (or into a new array
		// when a long limit name overflows it).
		b := append(t.buf[t.n:t.n], p.quoted...)
		b = append(b, ";r="...)
		b = append(b, remaining...)
		b = append(b, ";t="...)
		b = strconv.AppendInt(b, left, 10)
		t.vals[3], t.vals[4] = pl.header, t.keep(b)
		h["Ratelimit-Policy"] = t.vals[3:4:4]
		h["Ratelimit"] = t.vals[4:5:5]
	}
}

// ceilSeconds converts nanoseconds to whole seconds, rounding up.
func ceilSeconds(ns int64) int64 {
	s := ns / int64(time.Second)
	if ns%int64(time.Second) > 0 {
		s++
	}
	return s
}
