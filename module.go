// Package ratelimit is a Caddy HTTP handler that limits each client to a
// number of requests per time window, answering 429 Too Many Requests beyond it.
package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

func init() {
	caddy.RegisterModule(RateLimit{})
}

// Defaults of the options left unset.
const (
	DefaultZone       = "default"
	DefaultWindow     = time.Minute
	DefaultMax        = 300
	DefaultMaxTracked = 100_000
	DefaultIPv6Prefix = 64
	DefaultGCInterval = 5 * time.Minute

	// MaxWindow is the longest window accepted.
	MaxWindow = 366 * 24 * time.Hour

	// DefaultWSLeaseTTL is how long a WebSocket's lease in Redis lasts
	// unless renewed.
	DefaultWSLeaseTTL = 30 * time.Second

	// MaxRequests is the highest max accepted.
	MaxRequests = 1_000_000_000

	// MinMaxTracked is the lowest max_tracked accepted: below it, eviction
	// would let a handful of clients reset each other's windows.
	MinMaxTracked = 1000
)

// statusClientClosedRequest is the status of a request whose client went
// away before it was decided, as Caddy's reverse proxy reports it.
const statusClientClosedRequest = 499

// Header modes: which quota headers a response carries.
const (
	HeadersLegacy = "legacy" // X-RateLimit-Limit, X-RateLimit-Remaining, X-RateLimit-Reset
	HeadersIETF   = "ietf"   // RateLimit-Policy and RateLimit (draft-ietf-httpapi-ratelimit-headers-11)
	HeadersBoth   = "both"   // legacy and IETF
	HeadersNone   = "none"   // no quota headers (Retry-After is still sent on a 429)
)

// RateLimit limits each client (by default its IP address) to Max requests
// per Window. A request over the limit is refused with 429 Too Many Requests
// and a Retry-After header before any later handler runs; every response
// through the handler carries the quota headers.
//
// Counters belong to a zone: handlers that name the same zone share them, and
// they survive config reloads.
//
// A RateLimit is safe for concurrent use once provisioned.
type RateLimit struct {
	// Zone names the counters this handler uses. Handlers naming the same
	// zone share one set of counters and must agree on its settings.
	// Letters, digits and _ - . : only, and not "ui" (the admin
	// dashboard's path). Default: "default" (as is "" in
	// JSON; the Caddyfile refuses an empty value).
	Zone string `json:"zone,omitempty"`

	// Window is the length of the fixed window in which up to Max requests
	// per key are admitted. At least one second. In JSON it is a duration
	// string such as "1m" or "90s" (a bare number is nanoseconds, as
	// everywhere in Caddy's JSON); the Caddyfile also takes a bare integer
	// as seconds. Default: 1m.
	Window caddy.Duration `json:"window,omitempty"`

	// Max is the number of requests admitted per key per window. From 1 to
	// 1000000000. Default: 300 (0 in JSON means the default).
	Max int `json:"max,omitempty"`

	// MaxTracked bounds the memory a zone uses: at most this many keys are
	// tracked (a key of up to 15 bytes, such as an IPv4 address, takes
	// about 66 to 93 bytes; see docs/configuration.md). When full, expired windows are
	// purged first, then the keys tracked longest are evicted (FIFO). At
	// least 1000. Default: 100000.
	MaxTracked int `json:"max_tracked,omitempty"`

	// Key is a placeholder that names the client, such as
	// "{http.request.header.X-API-Key}". A key that resolves empty falls back
	// to the client IP. A key that is longer than 128 bytes, not valid UTF-8
	// or holds control or format characters is counted and listed as
	// "key:sha256:" and a hash. Every { must be closed by a }. Default: the
	// client IP, as Caddy resolves it through the server's trusted_proxies
	// (the {client_ip} placeholder).
	Key string `json:"key,omitempty"`

	// IPv6Prefix groups IPv6 clients by network: all addresses in one prefix
	// of this many bits share a counter. 128 counts every address on its own.
	// Applies to the client IP key only. Default: 64.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// Headers selects the quota headers: "legacy" (X-RateLimit-Limit,
	// X-RateLimit-Remaining, X-RateLimit-Reset), "ietf" (RateLimit-Policy and
	// RateLimit, draft-ietf-httpapi-ratelimit-headers-11), "both" or "none".
	// Default: "legacy".
	Headers string `json:"headers,omitempty"`

	// GCInterval is how often expired windows are purged in the background,
	// give or take a tenth at random. Default: 5m.
	GCInterval caddy.Duration `json:"gc_interval,omitempty"`

	// Enabled switches the handler off when false: every request passes
	// untouched, uncounted and without quota headers. Default: true.
	Enabled *bool `json:"enabled,omitempty"`

	// WSMaxConnectionsPerIP caps the WebSockets each key (the client IP, or
	// the custom key) may have open at once through the zone; a handshake
	// past the cap is refused as WSReject says. In a memory zone the count
	// is per Caddy process; in a Redis zone it is across every instance
	// sharing the Redis (each open socket holds a lease, see WSLeaseTTL),
	// and while Redis fails it falls back as on_error says: per process
	// (local), no cap (allow) or refused (deny). 0 means no cap. Default: 0
	// (unlimited).
	WSMaxConnectionsPerIP int `json:"ws_max_connections_per_ip,omitempty"`

	// WSLeaseTTL is, on a zone with the Redis store, how long an open
	// WebSocket's lease on its key's share of WSMaxConnectionsPerIP lasts
	// unless renewed (every third of it, while the socket lives): the
	// sockets of an instance that dies stop counting after this long. From
	// 3s to 1h. Default: 30s.
	WSLeaseTTL caddy.Duration `json:"ws_lease_ttl,omitempty"`

	// WSReject is how a WebSocket handshake over the rate or over
	// WSMaxConnectionsPerIP is refused: "close" completes the handshake and
	// closes at once with status 1013 Try Again Later (a 429 where the
	// connection cannot be taken over: HTTP/2 or HTTP/3 extended CONNECT);
	// "status" answers 429 Too Many Requests with the usual headers.
	// Default: "close".
	WSReject string `json:"ws_reject,omitempty"`

	// Store selects where the zone's counters live: in this process (the
	// default) or in Redis, shared by every Caddy instance using it. See
	// StoreConfig. Default: {"type": "memory"}.
	Store *StoreConfig `json:"store,omitempty"`

	// Missing says what the first limit does when Key resolves empty (or
	// the client IP is unknown): "ip" counts the request under the client
	// IP, "reject" refuses it with 400 Bad Request, any other value counts
	// it under that value (such as "anonymous"), listed as "missing:" and
	// the value: a bucket of its own that no client's key reaches, and
	// that a ban never touches (its count still refuses). Default: "ip".
	Missing string `json:"missing,omitempty"`

	// Limits are the handler's limits past its first, which Window, Max
	// and Key define and which is named after the zone. A request is
	// admitted only when every limit admits it; a refused request is
	// counted in none of them (each refusing limit tallies the refusal).
	// At most 7. Default: none.
	Limits []LimitConfig `json:"limits,omitempty"`

	// Algorithm is how every limit of the handler counts its window:
	// "fixed" windows (up to 2 x max can pass across a window edge) or
	// "sliding" (the sliding-window counter: the previous window's count,
	// weighted by how much of it still overlaps, plus the current one; at
	// most about max in any window), on either store. Default: "fixed".
	Algorithm string `json:"algorithm,omitempty"`

	// DryRun decides, sets the headers and placeholders, logs and counts
	// (result "dry_run") what would be refused, but refuses nothing. It
	// writes no ban and no escalation strike: a refusal that would start
	// a ban is logged and counted (caddy_rate_limit_dry_run_bans_total).
	// Counts carry over a reload as always. Handlers naming one zone must
	// agree on it. For trying a limit on live traffic. Default: false.
	DryRun bool `json:"dry_run,omitempty"`

	// Exempt lists client IP ranges (CIDRs or addresses) that are neither
	// counted nor limited and get no quota headers: health checkers, a
	// customer's NAT egress. Default: none.
	Exempt []string `json:"exempt,omitempty"`

	// Status is the status of a refusal, from 400 to 599. Default: 429.
	Status int `json:"status,omitempty"`

	// AbuseControls are count_status, cost, ban, ban_max and burst, for
	// every limit of the handler that sets none of its own.
	AbuseControls

	// Delay makes a request that would be admitted within this long wait
	// instead of being refused (nginx's limit_req delay), at most 1m. A
	// client that goes away while waiting spends nothing. Cannot be
	// combined with Ban. Default: no delay.
	Delay caddy.Duration `json:"delay,omitempty"`

	// DelayPerKey bounds the requests of one key waiting at once; one
	// more is refused. Default: 4.
	DelayPerKey int `json:"delay_per_key,omitempty"`

	// DelayTotal bounds the requests waiting at once in the handler.
	// Default: 1000.
	DelayTotal int `json:"delay_total,omitempty"`

	zone     *zone
	policies []policy // the first limit, then Limits
	// countStatus is set when a limit counts by response status.
	countStatus bool
	costWarned  *atomic.Bool // set once a bad cost value has been logged
	waitRoom    *waitRoom    // nil without delay
	inFlight    *inFlight    // nil unless a limit counts by status and bans
	// legacyHeaders and ietfHeaders say which quota headers Headers asks
	// for, decided once.
	legacyHeaders, ietfHeaders bool
	policyHeader               string // RateLimit-Policy value, formatted once
	exemptRanges               []netip.Prefix
	// errLimited is the error of every refusal, built once: a flood of
	// refused requests formats nothing. The key is in the log line and the
	// placeholders. refusal is the handler error that carries it, boxed
	// once: returning the struct as an error would allocate every time.
	errLimited error
	refusal    error
	logger     *zap.Logger

	// events is the config's events app, nil when it has none. Emitting
	// needs the caddy.Context the handler was provisioned with (it names
	// the event's origin), so it is kept here, as reverse_proxy does.
	events *caddyevents.App
	ctx    caddy.Context

	holdID uint64 // the handler's hold on its zone

	// proxy notices requests through a trusted proxy whose client IP the
	// client wrote; nil when no client can choose its key that way.
	proxy *proxyWatch

	// cutShared, when set, runs once, at the handler's first request, the
	// cuts of a shared store's windows that shorter windows end.
	cutShared *sync.Once
	cuts      []windowCut
}

// CaddyModule returns the Caddy module information.
func (RateLimit) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(RateLimit) },
	}
}

// Provision fills in defaults, checks the settings and takes the zone.
func (rl *RateLimit) Provision(ctx caddy.Context) error {
	rl.logger = ctx.Logger()
	if rl.Zone == "" {
		rl.Zone = DefaultZone
	}
	if rl.Window == 0 {
		rl.Window = caddy.Duration(DefaultWindow)
	}
	if rl.Max == 0 {
		rl.Max = DefaultMax
	}
	if rl.MaxTracked == 0 {
		rl.MaxTracked = DefaultMaxTracked
	}
	if rl.IPv6Prefix == 0 {
		rl.IPv6Prefix = DefaultIPv6Prefix
	}
	if rl.Headers == "" {
		rl.Headers = HeadersLegacy
	}
	if rl.GCInterval == 0 {
		rl.GCInterval = caddy.Duration(DefaultGCInterval)
	}
	if rl.WSLeaseTTL == 0 {
		rl.WSLeaseTTL = caddy.Duration(DefaultWSLeaseTTL)
	}
	if rl.WSReject == "" {
		rl.WSReject = WSRejectClose
	}
	if err := rl.check(); err != nil {
		return err
	}
	if err := rl.Store.provision(); err != nil {
		return err
	}

	sliding, gcra := rl.Algorithm == AlgorithmSliding, rl.Algorithm == AlgorithmGCRA
	first := limiter.Limit{Window: time.Duration(rl.Window), Max: rl.Max, Sliding: sliding, GCRA: gcra}
	rl.policies = []policy{newPolicy(rl.Zone, "", first, rl.Key, rl.Missing)}
	rl.policies[0].setAbuse(rl.AbuseControls)
	for _, l := range rl.Limits {
		key := l.Key
		if key == "" {
			key = rl.Key
		}
		lim := limiter.Limit{Window: time.Duration(l.Window), Max: l.Max, Sliding: sliding, GCRA: gcra}
		p := newPolicy(l.Name, l.Name, lim, key, l.Missing)
		p.setAbuse(l.abuse(rl.AbuseControls))
		rl.policies = append(rl.policies, p)
	}
	rl.countStatus, rl.costWarned, rl.inFlight = false, new(atomic.Bool), nil
	for i := range rl.policies {
		p := &rl.policies[i]
		rl.countStatus = rl.countStatus || p.countStatus != nil
		// A dry run writes no ban and no escalation strike: a refusal
		// that would start one reports it (refused).
		p.check.NoBan = rl.DryRun
		if p.holdsBan() && !rl.DryRun && rl.inFlight == nil {
			rl.inFlight = &inFlight{flights: map[string]*flight{}, ban: rl.startBan}
		}
	}
	rl.waitRoom = nil
	if rl.Delay > 0 {
		if rl.DelayPerKey == 0 {
			rl.DelayPerKey = DefaultDelayPerKey
		}
		if rl.DelayTotal == 0 {
			rl.DelayTotal = DefaultDelayTotal
		}
		rl.waitRoom = &waitRoom{byKey: map[string]int{}, perKey: rl.DelayPerKey, cap: rl.DelayTotal}
	}
	items := make([]string, len(rl.policies))
	for i := range rl.policies {
		items[i] = rl.policies[i].item()
	}
	rl.policyHeader = strings.Join(items, ", ")
	rl.legacyHeaders = rl.Headers == HeadersLegacy || rl.Headers == HeadersBoth
	rl.ietfHeaders = rl.Headers == HeadersIETF || rl.Headers == HeadersBoth
	rl.errLimited = fmt.Errorf("rate limit exceeded in zone %q", rl.Zone)
	rl.exemptRanges = nil
	for _, e := range rl.Exempt {
		p, _ := parsePrefix(e) // check refused a bad one
		rl.exemptRanges = append(rl.exemptRanges, p)
	}
	if rl.Status == 0 {
		rl.Status = http.StatusTooManyRequests
	}
	rl.refusal = caddyhttp.HandlerError{StatusCode: rl.Status, Err: rl.errLimited, Trace: "rate_limit"}

	// The metrics registry is made anew for each config load and shared by
	// all of its modules, whichever server they are in: it names the load.
	var load any
	if reg := ctx.GetMetricsRegistry(); reg != nil {
		load = reg
	}
	if err := claimZone(ctx.Context, load, rl.Zone, rl.sharedSettings()); err != nil {
		return err
	}
	z, _, err := zones.LoadOrNew(rl.poolKey(), func() (caddy.Destructor, error) {
		store, kind, closeStore := rl.Store.newStore(rl.Zone, rl.MaxTracked, rl.logger)
		return newZone(rl.Zone, kind, store, closeStore, rl.settings()), nil
	})
	if err != nil {
		return fmt.Errorf("loading zone %q: %w", rl.Zone, err)
	}
	rl.zone = z.(*zone)
	held := rl.zone.hold(rl.settings())
	for i := range rl.policies {
		rl.policies[i].check.Slot = held.limits[i].slot
		rl.policies[i].check.Limit.Since = held.limits[i].limit.Since
	}
	rl.holdID, rl.cuts, rl.cutShared = held.id, held.cuts, nil
	if len(held.cuts) > 0 {
		rl.cutShared = new(sync.Once)
	}
	rl.watchProxy(ctx)

	if reg := ctx.GetMetricsRegistry(); reg != nil {
		if err := registerMetrics(reg); err != nil {
			return err
		}
	}
	rl.events, err = eventsApp(ctx)
	if err != nil {
		return err
	}
	rl.ctx = ctx
	return nil
}

// Validate checks the settings. Provision already refuses bad ones, so that a
// zone is never created from them; Validate repeats the check for callers
// that validate without provisioning.
func (rl *RateLimit) Validate() error {
	return rl.check()
}

// Cleanup lets go of the zone; the last handler to let go of it stops it.
func (rl *RateLimit) Cleanup() error {
	if rl.zone == nil {
		return nil
	}
	// rl.zone stays set: a request still being served by the old config
	// may read it.
	rl.zone.release(rl.holdID)
	_, err := zones.Delete(rl.poolKey())
	return err
}

// ServeHTTP judges the request against every limit of the handler at once
// and either passes it on, with the quota headers set, or refuses it.
func (rl *RateLimit) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	if !rl.isEnabled() {
		return next.ServeHTTP(w, r)
	}
	ctx := r.Context()
	vars, _ := ctx.Value(caddyhttp.VarsCtxKey).(map[string]any)
	ip, _ := vars[caddyhttp.ClientIPVarKey].(string)
	// Until the first request through a trusted proxy, a request whose
	// client IP is not its peer's asks whether it came through one; after
	// it, nothing is asked. Before exempt: a client can claim an exempt
	// address as well.
	if rl.proxy != nil && !rl.proxy.seen.Load() && !fromPeer(r.RemoteAddr, ip) {
		rl.noticeProxy(vars)
	}
	if len(rl.exemptRanges) > 0 && rl.exempt(ip) {
		return next.ServeHTTP(w, r)
	}
	if rl.cutShared != nil {
		rl.cutShared.Do(rl.startSharedCut)
	}
	// The checks and verdicts go through the Store interface, so they
	// would escape to the heap: a pooled buffer keeps a request from
	// allocating them. It goes back to the pool without a defer: with
	// serve's many returns in the same function, Go could not open-code
	// the defer, and one that is not open-coded costs a call into the
	// runtime on every request. A request whose handlers panic (Caddy
	// recovers) leaves its buffer to the collector.
	d := decisions.Get().(*decision)
	err := rl.serve(w, r, next, d, vars, ip)
	d.release()
	return err
}

// serve decides the request, whose variables are vars and client IP ip,
// with the buffer d and answers it or passes it on.
func (rl *RateLimit) serve(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, d *decision, vars map[string]any, ip string) error {
	ctx := r.Context()
	repl := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	ipKey := rl.ipKey(ip)
	checks, of, out := &d.checks, &d.of, &d.out
	// Every limit's key first: a limit that rejects a request without its
	// key wins whatever the order; a limit with no key at all (no client
	// IP, missing ip) sits this request out.
	n := 0
	for i := range rl.policies {
		p := &rl.policies[i]
		key, err := p.resolve(repl, r.Header, ipKey)
		if err != nil {
			rl.zone.count(resultInvalid)
			return caddyhttp.Error(http.StatusBadRequest, err)
		}
		if key == "" {
			continue
		}
		d.n = n + 1 // before the key is written: release clears it
		checks[n], of[n] = p.check, i
		checks[n].Key = key
		if key == p.missingKey {
			// The bucket of every request without a key: its count
			// refuses, but a ban would lock out clients it shares.
			checks[n].Limit.Ban, checks[n].Limit.BanMax = 0, 0
		}
		if p.costKey != "" {
			checks[n].Cost = rl.requestCost(p, repl)
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
	now := time.Now()
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
	bp := &rl.policies[of[m]]
	reset := bp.resetOf(ceilSeconds(v.Reset.UnixNano()))
	st := requestVars(vars, repl)
	text := st.headerText()
	rl.setHeaders(w.Header(), text, bp, v, reset, now)
	st.placeholders = placeholders{
		zone:      rl.policies[0].nameAny, // the first limit is named after the zone
		policy:    bp.nameAny,
		key:       key,
		limit:     bp.maxAny,
		remaining: v.Remaining,
		reset:     reset.boxed,
		exceeded:  !allowed,
	}
	if !allowed {
		rl.refused(checks[:n], of[:n], out[:n], now)
	}
	ws := isWebSocket(r)
	if ws && (allowed || rl.DryRun) {
		return rl.serveWebSocket(w, r, next, st, checks[0].Key, v, allowed)
	}
	if delayed && !v.StoreError {
		rl.zone.count(resultDelayed)
	} else {
		rl.zone.countVerdict(allowed, v.StoreError, rl.DryRun)
	}
	if allowed && rl.countStatus {
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
	text.vals[5] = text.number(max(ceilSeconds(int64(wait)), 1))
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

// placeholders are one request's {http.rate_limit.*} values. The replacer
// asks for them only when a placeholder is used: setting seven values in its
// map for every request (a lock and a map write each, two values boxed) cost
// more than the decision.
type placeholders struct {
	zone, policy, limit, reset any // boxed once per limit
	key                        string
	remaining                  int
	exceeded                   bool
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
	buf  [48]byte // the request's state stays in a 256-byte size class
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
		return p.zone, true
	case "policy":
		return p.policy, true
	case "key":
		return p.key, true
	case "limit":
		return p.limit, true
	case "remaining":
		return p.remaining, true
	case "reset":
		return p.reset, true
	case "exceeded":
		return p.exceeded, true
	}
	return nil, false
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
	// entered marks the checks whose key the request is in flight in
	// (inFlight); kept those whose units stayed spent once it was served.
	entered, kept [limiter.MaxChecks]bool
}

// release returns d to the pool, holding no request's keys: refund holds
// at most the n checks in use.
func (d *decision) release() {
	clear(d.checks[:d.n])
	clear(d.refund[:d.n])
	clear(d.entered[:d.n])
	clear(d.kept[:d.n])
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
	cutter, ok := rl.zone.store.(limiter.SharedCutter)
	if !ok {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		for _, c := range rl.cuts {
			if err := cutter.CutWindows(ctx, c.check, c.cutoff); err != nil {
				rl.logger.Warn("cutting running windows to the shorter window", zap.String("zone", rl.Zone), zap.String("limit", rl.policies[0].name), zap.Error(err))
			}
		}
	}()
}

// ipKey returns the key of client IP ip, or "" if there is none.
func (rl *RateLimit) ipKey(ip string) string {
	if ip == "" {
		return ""
	}
	return clientIPKey(ip, rl.IPv6Prefix)
}

// setHeaders sets the quota headers of the configured mode for the limit
// that binds the request (p, whose verdict is v), with their values in t;
// reset is v.Reset in Unix seconds, rounded up. RateLimit-Policy lists
// every limit.
func (rl *RateLimit) setHeaders(h http.Header, t *headerText, p *policy, v limiter.Verdict, reset *resetText, now time.Time) {
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
		t.vals[3], t.vals[4] = rl.policyHeader, t.keep(b)
		h["Ratelimit-Policy"] = t.vals[3:4:4]
		h["Ratelimit"] = t.vals[4:5:5]
	}
}

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
	if rl.MaxTracked != 0 && rl.MaxTracked < MinMaxTracked {
		errs = append(errs, fmt.Errorf("invalid max_tracked %d: must be at least %d", rl.MaxTracked, MinMaxTracked))
	}
	if rl.IPv6Prefix < 0 || rl.IPv6Prefix > 128 {
		errs = append(errs, fmt.Errorf("invalid ipv6_prefix %d: must be between 1 and 128", rl.IPv6Prefix))
	}
	switch rl.Headers {
	case "", HeadersLegacy, HeadersIETF, HeadersBoth, HeadersNone:
	default:
		errs = append(errs, fmt.Errorf("invalid headers %q: must be legacy, ietf, both or none", rl.Headers))
	}
	if g := time.Duration(rl.GCInterval); g < 0 || (g > 0 && g < time.Second) {
		errs = append(errs, fmt.Errorf("invalid gc_interval %s: must be at least 1s", g))
	}
	if d := time.Duration(rl.WSLeaseTTL); d != 0 && (d < 3*time.Second || d > time.Hour) {
		errs = append(errs, fmt.Errorf("invalid ws_lease_ttl %s: must be from 3s to 1h", d))
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
	return errors.Join(errs...)
}

// isEnabled reports whether the handler limits at all.
func (rl *RateLimit) isEnabled() bool {
	return rl.Enabled == nil || *rl.Enabled
}

// sharedSettings describes the settings handlers naming one zone must share.
func (rl *RateLimit) sharedSettings() string {
	limits := make([]string, len(rl.Limits))
	for i, l := range rl.Limits {
		limits[i] = fmt.Sprintf("%s:%d/%s", l.Name, l.Max, time.Duration(l.Window)) + l.abuse(rl.AbuseControls).shared()
	}
	algorithm := rl.Algorithm
	if algorithm == "" {
		algorithm = AlgorithmFixed
	}
	return fmt.Sprintf("window=%s max=%d%s limits=[%s] algorithm=%s max_tracked=%d gc_interval=%s enabled=%t dry_run=%t store=%s",
		time.Duration(rl.Window), rl.Max, rl.AbuseControls.shared(), strings.Join(limits, " "), algorithm, rl.MaxTracked, time.Duration(rl.GCInterval), rl.isEnabled(), rl.DryRun, rl.Store.describe())
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

// ceilSeconds converts nanoseconds to whole seconds, rounding up.
func ceilSeconds(ns int64) int64 {
	s := ns / int64(time.Second)
	if ns%int64(time.Second) > 0 {
		s++
	}
	return s
}

// Interface guards
var (
	_ caddy.Provisioner           = (*RateLimit)(nil)
	_ caddy.Validator             = (*RateLimit)(nil)
	_ caddy.CleanerUpper          = (*RateLimit)(nil)
	_ caddyhttp.MiddlewareHandler = (*RateLimit)(nil)
)
