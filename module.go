// Package ratelimit is a Caddy HTTP handler that limits each client to a
// number of requests per time window, answering 429 Too Many Requests beyond it.
package ratelimit

import (
	"cmp"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
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
	DefaultMaxTracked = limiter.DefaultMaxTracked
	DefaultIPv6Prefix = 64
	DefaultGCInterval = 5 * time.Minute

	// MinWindow and MaxWindow bound a window (and a ban): whole seconds
	// from one second to 366 days.
	MinWindow = time.Second
	MaxWindow = 366 * 24 * time.Hour

	// MinWSLeaseTTL and MaxWSLeaseTTL bound ws_lease_ttl.
	MinWSLeaseTTL = 3 * time.Second
	MaxWSLeaseTTL = time.Hour

	// MinGCInterval is the shortest gc_interval.
	MinGCInterval = time.Second

	// DefaultWSLeaseTTL is how long a WebSocket's lease in Redis lasts
	// unless renewed.
	DefaultWSLeaseTTL = 30 * time.Second

	// MaxRequests is the highest max accepted.
	MaxRequests = 1_000_000_000

	// MinMaxTracked is the lowest max_tracked accepted: below it, eviction
	// would let a handful of clients reset each other's windows.
	MinMaxTracked = 1000

	// MaxIPv6Prefix is the longest ipv6_prefix: a whole address.
	MaxIPv6Prefix = 128

	// MaxLimitName is the longest limit name, in bytes.
	MaxLimitName = 32

	// MinStatus and MaxStatus bound the status of a refusal (status).
	MinStatus = 400
	MaxStatus = 599

	// MinFinalStatus is the lowest status a response ends with: a
	// count_status entry below it could never match (informational
	// statuses are never a response's last).
	MinFinalStatus = 200
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

	// MaxInFlight caps the requests of one key of the first limit that
	// are being served at once, 1 to 1000000; a request past it is
	// refused with Retry-After: 1 (or waits, with Delay) and spends
	// nothing. A memory zone counts this process's requests, a Redis
	// zone the fleet's, as leases that live WSLeaseTTL unless renewed.
	// Default: no cap.
	MaxInFlight int `json:"max_in_flight,omitempty"`

	// Calendar aligns the first limit's windows to the calendar in
	// TimeZone: "hour" (from :00), "day" (from midnight), "week" (from
	// Monday) or "month" (from the 1st), whatever the length of the day
	// or month; fixed or sliding, not gcra. Window is then the unit's
	// nominal length (1h, 24h, 168h, 744h), and may be left out. The
	// Caddyfile writes it as "window hour". Default: windows that start
	// at a key's request.
	Calendar string `json:"calendar,omitempty"`

	// TimeZone is the time zone of calendar windows, an IANA name such as
	// "Europe/Berlin". Default: UTC.
	TimeZone string `json:"time_zone,omitempty"`

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
	// WebSocket's lease on its key's share of WSMaxConnectionsPerIP, and a
	// request's slot of MaxInFlight, last unless renewed (every third of
	// it, while the socket or request lives): those of an instance that
	// dies stop counting after this long. From 3s to 1h. Default: 30s.
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
	Limits []PolicyConfig `json:"limits,omitempty"`

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

	// PlanBy is a placeholder that names the plan of each request, such
	// as "{http.vars.plan}" set by the map directive from an API key, or
	// an auth module's claim. A request whose plan is empty or not in
	// Plans gets the handler's own values (the plan "default"). A request
	// header lets clients choose their own plan: the handler warns at
	// load. Required with Plans.
	PlanBy string `json:"plan_by,omitempty"`

	// Plans are the plans PlanBy chooses from, by name (letters, digits, _
	// and -, at most 32, other than "default"; at most 1000 plans): each
	// one's max and burst for the handler's limits, or a limit switched
	// off. A limit keeps its window in every plan, and a key has one count
	// whatever its plan. See docs/plans.md.
	Plans map[string]PlanConfig `json:"plans,omitempty"`

	zone     *zone
	policies []policy // the first limit, then Limits: the default plan's
	// defaultPlan is the handler's own values; plans the others, by name
	// (nil without plans).
	defaultPlan *plan
	plans       map[string]*plan
	// planHeader and planVar are where PlanBy reads the plan when it is
	// exactly a request header's placeholder or a variable's; "" else.
	planHeader, planVar string
	overridePlans       *overridePlans // built in Provision
	// capsInFlight is set when a limit, or a plan's, has a max_in_flight.
	capsInFlight bool
	// violated caches the text of each set of refusing limits (a bit
	// mask of policies → *violatedText), built at its first refusal.
	violated *sync.Map
	// countStatus is set when a limit counts by response status.
	countStatus bool
	costWarned  *atomic.Bool // set once a bad cost value has been logged
	// charging is set when a limit charges what the response reports;
	// chargeWarned once a missing or bad charge has been logged.
	charging     bool
	chargeWarned *atomic.Bool
	waitRoom     *waitRoom // nil without delay
	inFlight     *inFlight // nil unless a limit counts by status and bans
	// legacyHeaders and ietfHeaders say which quota headers Headers asks
	// for, decided once.
	legacyHeaders, ietfHeaders bool
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

// Provision fills in defaults, checks the settings, and builds the handler
// and takes its zone. The check runs here, once, before anything is built:
// Caddy calls a Validate method only after Provision, by when a bad reload
// would have applied its settings to a running zone (a lower max_tracked
// evicts keys, a shorter window cuts windows) that the reload's failure
// cannot give back. The Caddyfile adapter runs the same check (check).
func (rl *RateLimit) Provision(ctx caddy.Context) error {
	rl.logger = ctx.Logger()
	if rl.Zone == "" {
		rl.Zone = DefaultZone
	}
	if rl.Window == 0 {
		rl.Window = caddy.Duration(cmp.Or(calendarWindow(rl.Calendar), DefaultWindow))
	}
	for i := range rl.Limits {
		if l := &rl.Limits[i]; l.Window == 0 {
			l.Window = caddy.Duration(calendarWindow(l.Calendar))
		}
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

	algo := limiter.FixedWindow
	switch rl.Algorithm {
	case AlgorithmSliding:
		algo = limiter.SlidingWindow
	case AlgorithmGCRA:
		algo = limiter.GCRA
	}
	loc, _ := rl.timeZone() // check refused a bad one
	first := limiter.Limit{Window: time.Duration(rl.Window), Max: rl.Max, Algorithm: algo, Calendar: calendarOf(rl.Calendar, loc)}
	rl.policies = []policy{newPolicy(rl.Zone, "", first, rl.Key, rl.Missing)}
	rl.policies[0].setAbuse(rl.AbuseControls)
	rl.policies[0].check.MaxInFlight = rl.MaxInFlight
	for _, l := range rl.Limits {
		key := l.Key
		if key == "" {
			key = rl.Key
		}
		lim := limiter.Limit{Window: time.Duration(l.Window), Max: l.Max, Algorithm: algo, Calendar: calendarOf(l.Calendar, loc)}
		p := newPolicy(l.Name, l.Name, lim, key, l.Missing)
		p.setAbuse(l.abuse(rl.AbuseControls))
		p.check.MaxInFlight = l.MaxInFlight
		rl.policies = append(rl.policies, p)
	}
	rl.countStatus, rl.costWarned, rl.inFlight = false, new(atomic.Bool), nil
	rl.charging, rl.chargeWarned = false, new(atomic.Bool)
	for i := range rl.policies {
		p := &rl.policies[i]
		rl.countStatus = rl.countStatus || p.countStatus != nil
		rl.charging = rl.charging || p.charge != ""
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
	rl.overridePlans, rl.violated = new(overridePlans), new(sync.Map)
	rl.warnClientPlan()
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
	var err error
	if rl.events, err = eventsApp(ctx); err != nil {
		return err
	}
	rl.ctx = ctx
	if err := claimZone(ctx.Context, load, rl.Zone, rl.sharedSettings()); err != nil {
		return err
	}
	z, _, err := zones.LoadOrNew(rl.poolKey(), func() (caddy.Destructor, error) {
		clk := clock.For(rl.Zone)
		store, kind, closeStore := rl.Store.newStore(rl.Zone, rl.MaxTracked, clk, rl.logger)
		return newZone(rl.Zone, kind, store, closeStore, clk, rl.settings()), nil
	})
	if err != nil {
		return fmt.Errorf("loading zone %q: %w", rl.Zone, err)
	}
	rl.zone = z.(*zone)
	if rl.inFlight != nil {
		rl.inFlight.clock = rl.zone.clock
	}
	held := rl.zone.hold(rl.settings())
	for i := range rl.policies {
		rl.policies[i].check.Slot = held.limits[i].slot
		rl.policies[i].check.Limit.Since = held.limits[i].limit.Since
	}
	rl.buildPlans() // copies of the policies, each with its slot and window start
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
	return nil
}

// settings returns what the zone runs with while rl is its newest holder
// (the slots and window starts are the zone's to give: see zone.hold).
func (rl *RateLimit) settings() zoneSettings {
	s := zoneSettings{
		enabled:    rl.isEnabled(),
		maxTracked: rl.MaxTracked,
		gcInterval: time.Duration(rl.GCInterval),
	}
	for _, p := range rl.policies {
		s.limits = append(s.limits, zonePolicy{name: p.name, storeName: p.check.Name, limit: p.check.Limit})
	}
	if rl.Store.isRedis() {
		s.timeout, s.onError, s.leaseTTL = time.Duration(rl.Store.Timeout), rl.Store.OnError, time.Duration(rl.WSLeaseTTL)
	}
	s.plans = rl.planRules()
	s.notify = overrideNotifier(rl.ctx, rl.events, rl.logger, rl.Zone)
	return s
}

// poolKey is the zone's key in zones: its name, and for a Redis zone what
// identifies its counters (connection, key prefix, key hashing, sync), so that a
// reload pointing the zone at another store builds a new zone instead of
// keeping the old store.
func (rl *RateLimit) poolKey() string {
	if rl.Store.isRedis() {
		return rl.Zone + "\x00" + rl.Store.identity
	}
	return rl.Zone
}

// sharedSettings describes the settings handlers naming one zone must share.
func (rl *RateLimit) sharedSettings() string {
	limits := make([]string, len(rl.Limits))
	for i, l := range rl.Limits {
		limits[i] = fmt.Sprintf("%s:%d/%s%s", l.Name, l.Max, time.Duration(l.Window), l.Calendar) + l.abuse(rl.AbuseControls).shared()
	}
	algorithm := rl.Algorithm
	if algorithm == "" {
		algorithm = AlgorithmFixed
	}
	s := fmt.Sprintf("window=%s max=%d%s limits=[%s] algorithm=%s max_tracked=%d gc_interval=%s enabled=%t dry_run=%t store=%s",
		time.Duration(rl.Window), rl.Max, rl.AbuseControls.shared(), strings.Join(limits, " "), algorithm, rl.MaxTracked, time.Duration(rl.GCInterval), rl.isEnabled(), rl.DryRun, rl.Store.describe())
	if rl.Calendar != "" || rl.TimeZone != "" {
		s += fmt.Sprintf(" calendar=%s time_zone=%s", rl.Calendar, rl.TimeZone)
	}
	if len(rl.Plans) > 0 {
		plans, _ := json.Marshal(rl.Plans) // sorted by name
		s += fmt.Sprintf(" plan_by=%s plans=%s", rl.PlanBy, plans)
	}
	return s
}

// Cleanup lets go of the zone; the last handler to let go of it stops it.
func (rl *RateLimit) Cleanup() error {
	if rl.zone == nil {
		return nil
	}
	// rl.zone stays set: a request still being served by the old config
	// may read it.
	rl.zone.unhold(rl.holdID)
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
	d.recycle()
	return err
}

// isEnabled reports whether the handler limits at all.
func (rl *RateLimit) isEnabled() bool {
	return rl.Enabled == nil || *rl.Enabled
}

// Interface guards
var (
	_ caddy.Provisioner           = (*RateLimit)(nil)
	_ caddy.CleanerUpper          = (*RateLimit)(nil)
	_ caddyhttp.MiddlewareHandler = (*RateLimit)(nil)
)
