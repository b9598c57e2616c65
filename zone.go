package ratelimit

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// zones holds every zone's store. It is a package-level UsagePool because a
// zone's counters must outlive the config that created them: on a reload the
// new config's handlers take the zone before the old config's handlers let go
// of it, so no count is lost.
var zones = caddy.NewUsagePool()

// zone is the state that handlers naming one zone share.
type zone struct {
	name  string
	seq   uint64 // order of creation: the newer of two zones of one name wins
	store limiter.Store

	// mem is the store when it is the in-process one, for the settings
	// only it has (max tracked, the sweep interval); nil otherwise.
	mem        *limiter.MemoryStore
	gcInterval atomic.Int64

	// redis is the store when it is the Redis one, nil otherwise;
	// redisConn names its client in redisClients.
	redis     *limiter.RedisStore
	redisConn string

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
	// refusals counts refusals by limit name (*atomic.Uint64); names come
	// from configs, so they stay few.
	refusals sync.Map
	// offenders are the keys refused in the last OffenderAge, in any
	// limit, so that an offender stays named after its window ends. On a
	// Redis zone, this instance's refusals only.
	offenders offenders

	// wsLive is the number of WebSocket connections open through the zone.
	wsLive atomic.Int64
	// ws counts the open WebSocket connections per key, for
	// ws_max_connections_per_ip.
	ws wsConns

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
	numResults
)

// resultNames are the result label values, indexed by outcome.
var resultNames = [numResults]string{"allowed", "limited", "dry_run", "invalid", "degraded_allowed", "degraded_denied", "delayed"}

// count records one decision with the given outcome.
func (z *zone) count(result int) { z.results[result].Add(1) }

// kind names the zone's store for the admin API: "memory" or "redis".
func (z *zone) kind() string {
	if z.mem != nil {
		return "memory"
	}
	return "redis"
}

// health reports the store's health ("HEALTHY", "DEGRADED", "RECOVERING")
// where the store has one (Redis), or "".
func (z *zone) health() string {
	if z.redis != nil {
		return z.redis.Health()
	}
	return ""
}

// zoneSettings is what a zone runs with: the settings of the newest handler
// holding it, as a plain value, so that the zone never points back at a
// config's handlers.
type zoneSettings struct {
	enabled    bool
	limits     []namedLimit // the first limit first
	maxTracked int
	gcInterval time.Duration
	timeout    time.Duration // Redis only
	onError    string        // Redis only
}

// holding is one handler's hold on the zone: an id the handler keeps, and
// its settings.
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
	return zoneSettings{enabled: true, limits: []namedLimit{{name: z.name, limit: limiter.Limit{Window: DefaultWindow, Max: DefaultMax}}}}
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

// hashedKeys reports whether the zone's store keeps HMAC hashes of the keys
// rather than the keys (a Redis store with hash_keys).
func (z *zone) hashedKeys() bool {
	return z.redis != nil && z.redis.HashedKeys()
}

// newZone builds a zone for the handler's settings and starts its sweeper.
func newZone(rl *RateLimit) *zone {
	ctx, cancel := context.WithCancel(context.Background())
	z := &zone{name: rl.Zone, seq: zoneSeq.Add(1), cancel: cancel}
	interval := func() time.Duration { return time.Duration(z.gcInterval.Load()) }
	if sc := rl.Store; sc.isRedis() {
		client, warm := loadRedisClient(sc)
		rs := limiter.NewRedisStore(limiter.RedisStoreOptions{
			Client:     client,
			Warmup:     warm,
			Prefix:     sc.KeyPrefix + rl.Zone + ":",
			HashKey:    sc.hashKey,
			MaxTracked: rl.MaxTracked,
			Logger:     rl.logger.With(zap.String("zone", rl.Zone)),
			Pipeline:   sc.Pipeline == PipelineOn,
		})
		z.store, z.redis, z.redisConn = rs, rs, sc.connKey
		z.apply(rl.settings())
		go rs.Run(ctx, interval)
		return z
	}
	mem := limiter.NewMemoryStore(rl.MaxTracked)
	z.store, z.mem = mem, mem
	z.apply(rl.settings())
	go mem.RunSweeper(ctx, interval)
	return z
}

// hold records that rl uses the zone and applies its settings. Each of its
// limits gets the zone's slot for its name. A limit whose window differs
// from the running one takes effect now: its Limit records when, so that
// windows begun under a longer one end a new window from now at the latest.
func (z *zone) hold(rl *RateLimit) {
	z.mu.Lock()
	defer z.mu.Unlock()
	var running *zoneSettings
	if n := len(z.holders); n > 0 {
		running = &z.holders[n-1].settings
	}
	for i := range rl.policies {
		p := &rl.policies[i]
		p.check.Slot = z.slotFor(p.check.Name, rl)
		if running == nil {
			continue
		}
		prev, ok := running.limit(p.check.Name)
		if !ok {
			continue
		}
		if prev.GCRA != p.check.Limit.GCRA && z.mem != nil {
			// A window count read as an arrival time, or the reverse,
			// means nothing: the limit starts afresh. (Redis tells them
			// apart: internal/limiter/redis.lua.)
			z.mem.ClearSlot(p.check.Slot)
		}
		switch {
		case prev.Window == p.check.Limit.Window:
			p.check.Limit.Since = prev.Since
		case p.check.Limit.Window > prev.Window:
			p.check.Limit.Since = time.Now()
		default:
			// A shorter window: every running window ends a new window
			// from now at the latest. The memory store is cut at once;
			// Redis, shared with other instances and with any "caddy
			// validate" run, is cut when this handler serves its first
			// request, so a config that never runs cuts nothing.
			p.check.Limit.Since = time.Now()
			cutoff := p.check.Limit.Since.Add(p.check.Limit.Window)
			if z.mem != nil {
				z.mem.CutWindows(p.check.Slot, cutoff)
			}
			if z.redis != nil && !p.check.Limit.Sliding && !p.check.Limit.GCRA {
				// A sliding window's keys outlive its end by a window
				// (internal/limiter/redis.lua): a shorter one applies from each
				// key's next window.
				rl.cutRedis = new(sync.Once)
				rl.cuts = append(rl.cuts, windowCut{p.check, cutoff})
			}
		}
	}
	rl.holdID = holdIDs.Add(1)
	h := holding{id: rl.holdID, settings: rl.settings()}
	z.holders = append(z.holders, h)
	z.apply(h.settings)
}

// settings returns what the zone runs with while rl is its newest holder.
func (rl *RateLimit) settings() zoneSettings {
	s := zoneSettings{
		enabled:    rl.isEnabled(),
		maxTracked: rl.MaxTracked,
		gcInterval: time.Duration(rl.GCInterval),
	}
	for _, p := range rl.policies {
		s.limits = append(s.limits, namedLimit{name: p.name, storeName: p.check.Name, slot: p.check.Slot, limit: p.check.Limit})
	}
	if rl.Store.isRedis() {
		s.timeout, s.onError = time.Duration(rl.Store.Timeout), rl.Store.OnError
	}
	return s
}

// slotFor returns the slot of the memory store that counts the limit
// stored under name: the slot it had, or a free one, or one that no holder
// (nor rl) uses any more. The first limit ("") is always slot 0. The caller
// holds z.mu.
func (z *zone) slotFor(name string, rl *RateLimit) int {
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
		return slices.ContainsFunc(rl.policies, func(p policy) bool { return p.check.Name == n })
	}
	take := func(i int) int {
		z.slots[i] = name
		if z.mem != nil {
			z.mem.SetSlotName(i, name)
		}
		if z.redis != nil {
			z.redis.SetSlotName(i, name)
		}
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
		if !slices.ContainsFunc(rl.policies, func(p policy) bool { return p.check.Name == z.slots[i] }) {
			return take(i)
		}
	}
	panic("rate_limit: no memory slot for limit " + name) // unreachable: see above
}

// release records that rl no longer uses the zone, and applies the settings
// of the newest handler still holding it.
func (z *zone) release(rl *RateLimit) {
	z.mu.Lock()
	defer z.mu.Unlock()
	z.holders = slices.DeleteFunc(z.holders, func(h holding) bool { return h.id == rl.holdID })
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
// hold and release call it.
func (z *zone) apply(s zoneSettings) {
	z.gcInterval.Store(int64(s.gcInterval))
	if z.mem != nil {
		z.mem.SetMaxTracked(s.maxTracked)
	}
	if z.redis != nil {
		limits := make([]limiter.Check, len(s.limits))
		for i, l := range s.limits {
			limits[i] = limiter.Check{Slot: l.slot, Name: l.storeName, Limit: l.limit}
		}
		z.redis.SetLimits(limits)
		z.redis.SetMaxTracked(s.maxTracked)
		z.redis.SetTimeout(s.timeout)
		z.redis.SetOnError(s.onError)
	}
}

// Destruct stops the zone's background work when the last handler naming it
// is cleaned up.
func (z *zone) Destruct() error {
	z.cancel()
	if z.redis != nil {
		return releaseRedisClient(z.redisConn)
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

// poolKey is the zone's key in zones: its name, and for a Redis zone what
// identifies its counters (connection, key prefix, key hashing), so that a
// reload pointing the zone at another store builds a new zone instead of
// keeping the old store.
func (rl *RateLimit) poolKey() string {
	if rl.Store.isRedis() {
		return rl.Zone + "\x00" + rl.Store.identity
	}
	return rl.Zone
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
