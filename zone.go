package ratelimit

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// zones holds every zone's store. It is a package-level UsagePool because a
// zone's counters must outlive the config that created them: on a reload the
// new config's handlers take the zone before the old config's handlers let go
// of it, so no count is lost.
var zones = caddy.NewUsagePool()

// zone is the state that handlers naming one zone share.
type zone struct {
	name string
	seq  uint64 // order of creation: the newer of two zones of one name wins

	// store keeps the counters. What only a store shared by a fleet does
	// (health, leases, key counts, sync) the zone asks it for: fleet and
	// syncer.
	store limiter.Store
	// storeKind names the store for the admin API: "memory" or "redis".
	storeKind string
	// closeStore lets go of what the store shares with other zones (a
	// Redis client); nil when nothing.
	closeStore func() error

	gcInterval atomic.Int64

	// slots names the limit each memory store slot counts ("" for the
	// first limit and for free slots).
	slots [limiter.MaxChecks]string

	// holders are the holds of the handlers holding the zone, in
	// provisioning order; the zone runs with the settings of the newest, so
	// that a reload applies its settings and a failed reload, whose handlers
	// let go, restores the running config's.
	mu      sync.Mutex
	holders []holding

	// results counts decisions by outcome since the zone was created; the
	// metrics read them, so a config reload never resets a counter.
	results [numResults]atomic.Uint64
	// dryRunBans counts the bans dry-run handlers would have started.
	dryRunBans atomic.Uint64
	// charged counts the units responses charged (charge), and
	// chargeFaults the responses whose charge was missing or invalid.
	charged      atomic.Uint64
	chargeFaults [numChargeFaults]atomic.Uint64
	// refusals counts refusals by limit name (*atomic.Uint64); names come
	// from configs, so they stay few.
	refusals sync.Map
	// offenders are the keys refused in the last OffenderAge, in any
	// limit, so that an offender stays named after its window ends. On a
	// Redis zone, this instance's refusals only.
	offenders offenders

	// wsLive is the number of WebSocket connections open through the zone.
	wsLive atomic.Int64
	// flying is the number of requests holding slots of max_in_flight;
	// inFlightEvent when the zone last emitted EventInFlightExceeded
	// (Unix ns).
	flying, inFlightEvent atomic.Int64
	// ws counts the open WebSocket connections per key, for
	// ws_max_connections_per_ip.
	ws wsConns

	// clock is the time the zone's handlers and store read (clock.For).
	clock clock.Clock

	// overrides are the keys whose limits the admin API set.
	overrides zoneOverrides

	cancel context.CancelFunc
}

// Decision outcomes, as the result label of the requests metric: the
// terminal states of a request.
const (
	resultAllowed         = iota // admitted
	resultLimited                // refused for being over a limit
	resultDryRun                 // over a limit but let through by dry run
	resultInvalid                // refused with 400: a limit that rejects a request without its key
	resultDegradedAllowed        // admitted while the shared store failed (on_error allow, or local admitted)
	resultDegradedDenied         // refused with 503 because the shared store failed (on_error deny)
	resultDelayed                // admitted after waiting (delay)
	resultInFlight               // refused for the key's requests in flight (max_in_flight)
	numResults
)

// resultNames are the result label values, indexed by outcome.
var resultNames = [numResults]string{"allowed", "limited", "dry_run", "invalid", "degraded_allowed", "degraded_denied", "delayed", "in_flight"}

// count records one decision with the given outcome.
func (z *zone) count(result int) { z.results[result].Add(1) }

// kind names the zone's store for the admin API: "memory" or "redis".
func (z *zone) kind() string { return z.storeKind }

// fleet returns the zone's store as a store shared by a fleet (Redis);
// ok is false for a store of this process alone.
func (z *zone) fleet() (f limiter.Fleet, ok bool) {
	f, ok = z.store.(limiter.Fleet)
	return f, ok
}

// syncStats returns the figures of the zone's store in sync mode; ok is
// false in any other mode.
func (z *zone) syncStats(now time.Time) (limiter.SyncStats, bool) {
	if sy, ok := z.store.(limiter.Syncer); ok {
		return sy.SyncStats(now), true
	}
	return limiter.SyncStats{}, false
}

// health reports the store's health ("HEALTHY", "DEGRADED", "RECOVERING")
// where the store has one (Redis), or "".
func (z *zone) health() string {
	if f, ok := z.fleet(); ok {
		return f.Health()
	}
	return ""
}

// zoneSettings is what a zone runs with: the settings of the newest handler
// holding it, as a plain value, so that the zone never points back at a
// config's handlers.
type zoneSettings struct {
	enabled    bool
	limits     []zonePolicy // the first limit first
	maxTracked int
	gcInterval time.Duration
	timeout    time.Duration // Redis only
	onError    string        // Redis only
	leaseTTL   time.Duration // Redis only: a lease of a request in flight
	plans      planRules     // what an override is checked against
	// notify logs an override's change and emits its event, as the
	// handler would.
	notify func(event string, data map[string]any)
}

// zoneHold is what a zone gives a handler that holds it: the id it lets go
// of the zone with, its limits with the zone's slot and window start for
// each (in the order it gave them), and the running windows it cuts once it
// serves (a shared store's, which a config only validated must not cut).
type zoneHold struct {
	id     uint64
	limits []zonePolicy
	cuts   []windowCut
}

// windowCut is a limit whose window a reload shortened: its running windows
// end at cutoff at the latest.
type windowCut struct {
	check  limiter.Check
	cutoff time.Time
}

// holding is one handler's hold on the zone: its id, and its settings.
type holding struct {
	id       uint64
	settings zoneSettings
	// spoofable is set once a request reached the handler through a
	// trusted proxy whose client IP, which the handler's keys go by, the
	// client wrote (proxy.go). It lives and goes with the hold, so a reload
	// recomputes it from the new config's requests.
	spoofable bool
}

// holdIDs numbers the holds on zones.
var holdIDs atomic.Uint64

// newest returns the settings the zone runs with: the newest holder's, or
// the defaults while no handler holds it yet.
func (z *zone) newest() zoneSettings {
	z.mu.Lock()
	defer z.mu.Unlock()
	if n := len(z.holders); n > 0 {
		return z.holders[n-1].settings
	}
	return zoneSettings{enabled: true, limits: []zonePolicy{{name: z.name, limit: limiter.Limit{Window: DefaultWindow, Max: DefaultMax}}}}
}

// limit returns the zone's limit stored under name in s.
func (s zoneSettings) limit(name string) (limiter.Limit, bool) {
	for _, l := range s.limits {
		if l.storeName == name {
			return l.limit, true
		}
	}
	return limiter.Limit{}, false
}

// zoneSeq numbers zones in the order they are created.
var zoneSeq atomic.Uint64

// newZone builds a zone named name around store (of kind storeKind, let go
// of with closeStore), reading clk, running with s until a handler holds
// it, and starts the store's background work.
func newZone(name, storeKind string, store limiter.Store, closeStore func() error, clk clock.Clock, s zoneSettings) *zone {
	ctx, cancel := context.WithCancel(context.Background())
	z := &zone{name: name, seq: zoneSeq.Add(1), store: store, storeKind: storeKind, closeStore: closeStore, clock: clk, cancel: cancel}
	z.apply(s)
	z.watchOverrides()
	go store.Run(ctx, func() time.Duration { return time.Duration(z.gcInterval.Load()) })
	return z
}

// hold records a handler that runs with s, and applies s. Each limit of s
// gets the zone's slot for its name. A limit whose window differs from the
// running one takes effect now: its Limit records when, so that windows
// begun under a longer one end a new window from now at the latest. The
// returned hold says what the handler runs its limits with.
func (z *zone) hold(s zoneSettings) zoneHold {
	z.mu.Lock()
	defer z.mu.Unlock()
	var running *zoneSettings
	if n := len(z.holders); n > 0 {
		running = &z.holders[n-1].settings
	}
	s.limits = slices.Clone(s.limits)
	var cuts []windowCut
	for i := range s.limits {
		l := &s.limits[i]
		l.slot = z.slotFor(l.storeName, s)
		if running == nil {
			continue
		}
		prev, ok := running.limit(l.storeName)
		if !ok {
			continue
		}
		switch {
		case prev.Window == l.limit.Window:
			l.limit.Since = prev.Since
		case l.limit.Window > prev.Window:
			l.limit.Since = z.clock.Now()
		default:
			// A shorter window: every running window ends a new window
			// from now at the latest. A store of this process is cut at
			// once; a shared one (Redis, shared with other instances and
			// with any "caddy validate" run) when the handler serves its
			// first request, so a config that never runs cuts nothing.
			l.limit.Since = z.clock.Now()
			cut := windowCut{limiter.Check{Slot: l.slot, Name: l.storeName, Limit: l.limit}, l.limit.Since.Add(l.limit.Window)}
			if _, shared := z.fleet(); !shared {
				_ = z.store.CutWindows(context.Background(), cut.check, cut.cutoff) // a memory store's never fails
			} else if l.limit.Algorithm == limiter.FixedWindow {
				// A sliding window's keys outlive its end by a window
				// (internal/limiter/redis.lua): a shorter one applies from each
				// key's next window.
				cuts = append(cuts, cut)
			}
		}
	}
	h := holding{id: holdIDs.Add(1), settings: s}
	z.holders = append(z.holders, h)
	z.apply(h.settings)
	return zoneHold{id: h.id, limits: s.limits, cuts: cuts}
}

// slotFor returns the slot of the memory store that counts the limit
// stored under name: the slot it had, or a free one, or one that no holder
// (nor s, the settings being held) uses any more. The first limit ("") is
// always slot 0. The caller holds z.mu.
func (z *zone) slotFor(name string, s zoneSettings) int {
	if name == "" {
		return 0
	}
	for i := 1; i < limiter.MaxChecks; i++ {
		if z.slots[i] == name {
			return i
		}
	}
	inUse := func(n string) bool {
		for _, h := range z.holders {
			if _, ok := h.settings.limit(n); ok {
				return true
			}
		}
		_, ok := s.limit(n)
		return ok
	}
	take := func(i int) int {
		z.slots[i] = name
		return i
	}
	for i := 1; i < limiter.MaxChecks; i++ {
		if z.slots[i] == "" || !inUse(z.slots[i]) {
			return take(i)
		}
	}
	// Every slot is held: the config being replaced and this one name more
	// limits together than there are slots. Take one of a limit this
	// config drops (there is one: a config has at most MaxChecks-1 limits
	// past its first); what the old config's last requests count in it
	// lands in the new limit, a moment's overlap.
	for i := 1; i < limiter.MaxChecks; i++ {
		if _, ok := s.limit(z.slots[i]); !ok {
			return take(i)
		}
	}
	panic("rate_limit: no memory slot for limit " + name) // unreachable: see above
}

// unhold records that the handler holding the zone under id no longer
// uses it, and applies the settings of the newest handler still holding it.
func (z *zone) unhold(id uint64) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.holders = slices.DeleteFunc(z.holders, func(h holding) bool { return h.id == id })
	if n := len(z.holders); n > 0 {
		z.apply(z.holders[n-1].settings)
	}
}

// markSpoofable records that the handler holding the zone under id is
// keyed by a client IP that clients choose.
func (z *zone) markSpoofable(id uint64) {
	z.mu.Lock()
	defer z.mu.Unlock()
	for i := range z.holders {
		if z.holders[i].id == id {
			z.holders[i].spoofable = true
		}
	}
}

// spoofableKey reports whether any handler holding the zone is keyed by a
// client IP that clients choose.
func (z *zone) spoofableKey() bool {
	z.mu.Lock()
	defer z.mu.Unlock()
	return slices.ContainsFunc(z.holders, func(h holding) bool { return h.spoofable })
}

// apply takes the settings of the newest holder, so that a reload that
// changes them takes effect without dropping the zone's counts. newZone,
// hold and unhold call it.
func (z *zone) apply(s zoneSettings) {
	z.gcInterval.Store(int64(s.gcInterval))
	limits := make([]limiter.Check, len(s.limits))
	for i, l := range s.limits {
		limits[i] = limiter.Check{Slot: l.slot, Name: l.storeName, Limit: l.limit}
	}
	z.store.Configure(limiter.Settings{MaxTracked: s.maxTracked, Limits: limits, Timeout: s.timeout, OnError: s.onError, LeaseTTL: s.leaseTTL})
}

// Destruct stops the zone's background work when the last handler naming it
// is cleaned up.
func (z *zone) Destruct() error {
	z.cancel()
	if z.closeStore != nil {
		return z.closeStore()
	}
	return nil
}

// countVerdict records a decision the store reached: allowed, or
// degraded_allowed when the shared store failed and on_error admitted it;
// limited, or dry_run when the handler only tries its limits.
func (z *zone) countVerdict(allowed, storeError, dryRun bool) {
	switch {
	case allowed && storeError:
		z.count(resultDegradedAllowed)
	case allowed:
		z.count(resultAllowed)
	case dryRun:
		z.count(resultDryRun)
	default:
		z.count(resultLimited)
	}
}

// refusalCounter returns the named limit's refusal counter, creating it
// at the limit's first refusal.
func (z *zone) refusalCounter(limit string) *atomic.Uint64 {
	c, ok := z.refusals.Load(limit)
	if !ok {
		c, _ = z.refusals.LoadOrStore(limit, new(atomic.Uint64))
	}
	return c.(*atomic.Uint64)
}

// loadZones records, for each config being loaded, the settings every zone
// was given, so that two handlers of one config, in one server or in two,
// cannot name the same zone with different settings. An entry goes when the
// config's context ends.
var loadZones sync.Map // config identity → *sync.Map (zone name → settings string)

// claimZone records that a handler of the config identified by load (ctx is
// that config's context) names zone with settings, and fails if another
// handler of that config named the zone with different ones.
func claimZone(ctx context.Context, load any, zone, settings string) error {
	if load == nil {
		return nil
	}
	perLoad, loaded := loadZones.LoadOrStore(load, new(sync.Map))
	if !loaded {
		context.AfterFunc(ctx, func() { loadZones.Delete(load) })
	}
	prev, loaded := perLoad.(*sync.Map).LoadOrStore(zone, settings)
	if loaded && prev.(string) != settings {
		return fmt.Errorf("zone %q is configured twice with different settings: %s and %s", zone, prev, settings)
	}
	return nil
}

// Interface guards
var _ caddy.Destructor = (*zone)(nil)
