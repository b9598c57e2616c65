package limiter

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// What a RedisStore does when Redis fails or is too slow to answer.
const (
	OnErrorLocal = "local" // keep limiting with an in-process store until Redis is back
	OnErrorAllow = "allow" // admit the request (fail open)
	OnErrorDeny  = "deny"  // refuse the request with 503 (fail closed)
)

// ErrRedisDegraded is the error a degraded RedisStore reports, without
// waiting on Redis, when on_error is deny.
var ErrRedisDegraded = errors.New("redis store is degraded: redis failed repeatedly and is being probed")

// RedisStoreOptions configure a RedisStore.
type RedisStoreOptions struct {
	// Client is the connection to Redis, possibly shared with other stores.
	// The store never closes it.
	Client redis.UniversalClient
	// Warmup is Client's warm-up, shared by the stores sharing Client.
	// Default: one of the store's own.
	Warmup *Warmup
	// Prefix starts every key the store writes; it should name the zone, so
	// zones sharing one Redis never share counters.
	Prefix string
	// HashKey, when set, makes the store write HMAC-SHA256(HashKey, key) in
	// hex instead of the client key, so Redis holds no IP address.
	HashKey []byte
	// Timeout bounds each decision's round trip. Default: 100ms.
	Timeout time.Duration
	// OnError is OnErrorLocal, OnErrorAllow or OnErrorDeny. Default: local.
	OnError string
	// MaxTracked bounds the in-process state: the local fallback store and
	// the cache of keys known to be over their limit. Default: 100000.
	MaxTracked int
	// Logger receives health changes. Default: none.
	Logger *zap.Logger
	// Pipeline sends decisions through the client's auto-pipeliner, which
	// writes the decisions that wait at the same moment as one pipeline
	// (each still one atomic script), instead of each on its own. Not for
	// a Cluster client: a Cluster pipeline re-sends a node's whole batch
	// after a transport error, counting requests twice. See
	// docs/redis.md for what else it trades.
	Pipeline bool
	// Sync, when positive, is sync mode's interval: decisions are made in
	// memory from the fleet's counts as last read, and every Sync the
	// store sends the counts of the keys it touched and reads the
	// fleet's back (redis_sync.lua). Windows are then aligned to the
	// clock. Zero: every decision is a round trip (exact mode).
	Sync time.Duration
	// SyncSpend is SyncShare (default) or SyncAll.
	SyncSpend string
	// SyncTimeout bounds each of sync mode's round trips, apart from a
	// decision's Timeout: a round of thousands of keys on a busy host
	// takes longer than one decision. Default: DefaultSyncTimeout.
	SyncTimeout time.Duration
}

// RedisStore is a Store whose counters live in Redis, so that every Caddy
// instance sharing the Redis shares the limit. Each decision is one atomic
// Lua call; a key known to be over its limit is refused in-process until its
// window resets, so a flood costs Redis nothing per request (Run adds the
// refusals so answered to the key's refused tally once a second).
//
// The decisions that arrive before the client's first contact with Redis
// ends wait for it, up to StartupWait (see Warmup), rather than fail on a
// client still learning a Cluster's topology.
//
// When Redis fails or times out, the store applies its on_error mode. After
// repeated failures it is DEGRADED and stops waiting on Redis; a probe run by
// Run moves it to RECOVERING once Redis answers, and to HEALTHY after
// consecutive successes.
//
// The zero value is not usable; call NewRedisStore. A RedisStore is safe for
// concurrent use.
type RedisStore struct {
	client  redis.UniversalClient
	warm    *Warmup              // the client's first contact, which the first decisions wait for
	pipe    *redis.AutoPipeliner // batches concurrent decisions; nil: one call each
	prefix  string
	hashKey []byte
	timeout atomic.Int64 // time.Duration
	// deadline is the context the decisions starting now share.
	deadline atomic.Pointer[decisionDeadline]
	boxed    atomic.Pointer[boxedLimit] // the last fixed limit's script arguments
	onError  atomic.Pointer[string]
	local    *MemoryStore // the on_error local fallback
	refused  refusedCache
	limits   atomic.Pointer[[]Check] // the zone's limits (SetLimits)
	used     chan struct{}           // closed at the first decision or unblock
	useOnce  sync.Once
	logger   *zap.Logger

	state      atomic.Int32
	streak     atomic.Int32 // consecutive failures when healthy, successes when recovering
	wake       chan struct{}
	probeEvery time.Duration

	counts keyCounter // the counts of the zone's keys (CountKeys)

	sync *syncTable // sync mode's table; nil in exact mode
}

// NewRedisStore returns a RedisStore. It does not connect: the first decision
// does, and starts the client's warm-up (Warmup).
func NewRedisStore(opts RedisStoreOptions) *RedisStore {
	if opts.MaxTracked <= 0 {
		opts.MaxTracked = DefaultMaxTracked
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Warmup == nil {
		opts.Warmup = NewWarmup(opts.Client)
	}
	s := &RedisStore{
		client:     opts.Client,
		warm:       opts.Warmup,
		prefix:     opts.Prefix,
		hashKey:    opts.HashKey,
		local:      NewMemoryStore(opts.MaxTracked),
		logger:     opts.Logger,
		wake:       make(chan struct{}, 1),
		used:       make(chan struct{}),
		probeEvery: defaultProbeEvery,
	}
	if _, cluster := opts.Client.(*redis.ClusterClient); opts.Pipeline && opts.Client != nil && !cluster {
		// go-redis batches the commands of concurrent callers into one
		// write per round trip. Its asynchronous face is used, so that
		// each decision waits for its reply only until its own deadline
		// (a command, once queued, ignores its context), and the queue is
		// bounded so that a hung Redis cannot pile decisions up. A client
		// that has none (a Ring) decides one call at a time.
		cfg := redis.DefaultAutoPipelineOptions()
		cfg.MaxQueuedCommands = pipelineQueue
		if ap, err := opts.Client.AsyncAutoPipelineWithOptions(cfg); err == nil {
			s.pipe = ap
		} else {
			opts.Logger.Debug("redis auto-pipelining unavailable; decisions are sent one by one", zap.Error(err))
		}
	}
	if opts.Sync > 0 {
		s.sync = newSyncTable(opts.Sync, opts.SyncSpend, newInstanceID(), opts.MaxTracked, opts.SyncTimeout)
	}
	s.refused.init(opts.MaxTracked)
	s.counts.init()
	s.SetTimeout(opts.Timeout)
	s.SetOnError(opts.OnError)
	return s
}

// SetTimeout changes the bound on each decision's round trip; a non-positive
// one restores the default of 100ms.
func (s *RedisStore) SetTimeout(d time.Duration) {
	if d <= 0 {
		d = DefaultTimeout
	}
	s.timeout.Store(int64(d))
}

// SetOnError changes what the store does when Redis fails: OnErrorLocal (also
// for ""), OnErrorAllow or OnErrorDeny.
func (s *RedisStore) SetOnError(mode string) {
	if mode == "" {
		mode = OnErrorLocal
	}
	s.onError.Store(&mode)
}

// SetMaxTracked changes the bound on the store's in-process state.
func (s *RedisStore) SetMaxTracked(n int) {
	if s.sync != nil {
		s.sync.cap.Store(int64(n))
	}
	s.local.SetMaxTracked(n)
	s.refused.setCap(n)
}

// slowTimeout bounds one step of work no request waits on (a flush, a
// Range page, a Forget): the decision timeout, but at least a second.
func (s *RedisStore) slowTimeout() time.Duration {
	return max(time.Duration(s.timeout.Load()), time.Second)
}

// HashedKeys reports whether keys are stored as HMAC hashes, so that Range
// lists hashes rather than client keys.
func (s *RedisStore) HashedKeys() bool { return s.hashKey != nil }

// Hit decides one request against limit alone: Decide with one check in
// slot 0, of name "".
func (s *RedisStore) Hit(ctx context.Context, key string, now time.Time, limit Limit) (Verdict, error) {
	// Not a shared helper taking s.Decide as a func value: through one,
	// the check and verdict escape to the heap on every call.
	var out [1]Verdict
	err := s.Decide(ctx, []Check{{Key: key, Limit: limit}}, now, out[:])
	return out[0], err
}

// Decide implements Store. It returns an error only when Redis failed and
// on_error is deny; with allow or local the verdicts have StoreError set.
//
// On a single Redis or Sentinel the decision is one script call. On a
// Cluster, the checks whose keys share a slot (the limits of one client key
// do) are one call; checks in several slots are decided slot by slot, each
// call reserving its counts when its limits admit, and a refusal in any slot
// gives the reservations back (redis_release.lua). The Cluster never
// admits more than a limit allows and leaves no count of a refused request;
// while a reservation is being given back, a concurrent request may be
// refused that an exact decision would admit.
func (s *RedisStore) Decide(ctx context.Context, checks []Check, now time.Time, out []Verdict) error {
	n := len(checks)
	if n > MaxChecks || len(out) < n {
		return fmt.Errorf("redis store: %d checks for %d verdicts, at most %d", n, len(out), MaxChecks)
	}
	s.markUsed()
	if s.sync != nil {
		s.decideSync(ctx, checks, now, out)
		return nil
	}
	t := now.UnixNano()
	var resets [MaxChecks]int64
	var pending [MaxChecks]bool
	cached := false
	for i := range checks {
		c := &checks[i]
		if reset, pend, ok := s.refused.get(cacheKey(c.Name, c.Key), t, c); ok {
			resets[i], pending[i], cached = reset, pend, true
		}
	}
	if cached {
		// Limits known to refuse: so is the request, with no round trip.
		// The others were not asked; their verdicts say only that.
		for i := range checks {
			c := &checks[i]
			out[i] = Verdict{Allowed: true, Max: c.Limit.Max, Remaining: c.Limit.Max, Reset: now.Add(c.Limit.Window)}
			if r := resets[i]; r != 0 {
				out[i] = Verdict{Max: c.Limit.Max, Reset: time.Unix(0, r), RetryAfter: time.Duration(r - t), PendingBan: pending[i]}
			}
		}
		return nil
	}
	if s.state.Load() == stateDegraded {
		return s.fallback(ctx, checks, now, out, ErrRedisDegraded)
	}
	// A decision that arrives before the client's first contact with Redis
	// ends waits for it, and then has its whole timeout.
	s.awaitWarm(ctx)
	err := s.decideRedis(ctx, checks, now, out)
	if err != nil {
		if ctx.Err() != nil {
			// The request itself was cancelled: no verdict, and no
			// evidence against Redis.
			return fmt.Errorf("redis store: %w", ctx.Err())
		}
		s.failed(err)
		return s.fallback(ctx, checks, now, out, err)
	}
	s.succeeded()
	for i := range checks {
		c := &checks[i]
		if !out[i].Allowed && c.cost() == 1 {
			// Cached until a request fits again: the window's end, or
			// for a sliding window when the previous count has faded
			// enough (or the ban's end). A costly request's refusal is
			// not: its wait is not a cheaper request's.
			unbanned := c.Limit.Ban == 0 || out[i].PendingBan
			s.refused.put(cacheKey(c.Name, c.Key), t+int64(out[i].RetryAfter), c.Limit.Max, unbanned, t)
		}
	}
	return nil
}

// refundMargin is how long before its window ends a refund is still sent:
// closer to the end, the window may have ended in Redis and the refund
// would spend a unit of the next one.
const refundMargin = 20 * time.Millisecond

// Refund implements Store. Each check's units go back in one call per key
// (the keys of one decision may be in several Cluster slots); a window that
// ends within refundMargin is left alone, and a GCRA bucket gets back only
// what has not dripped back yet. A refund also reaches the local fallback
// store when the decision was made there.
func (s *RedisStore) Refund(ctx context.Context, checks []Check, now time.Time, verdicts []Verdict) error {
	if s.sync != nil {
		s.refundSync(checks, verdicts)
		return nil
	}
	var groups [][]int
	for i := range checks {
		if i >= len(verdicts) || !verdicts[i].Allowed {
			continue
		}
		if verdicts[i].StoreError {
			_ = s.local.Refund(ctx, checks[i:i+1], now, verdicts[i:i+1])
			continue
		}
		if verdicts[i].Reset.Sub(now) < refundMargin {
			continue // the window has ended, or the units have dripped back
		}
		groups = append(groups, []int{i})
	}
	s.release(ctx, checks, groups, verdicts, now)
	for _, g := range groups {
		// A refusal cached while this request held its units may no
		// longer hold.
		c := &checks[g[0]]
		s.refused.forget(cacheKey(c.Name, c.Key))
	}
	return nil
}

// fallback decides without Redis, as on_error says.
func (s *RedisStore) fallback(ctx context.Context, checks []Check, now time.Time, out []Verdict, cause error) error {
	switch *s.onError.Load() {
	case OnErrorAllow:
		for i, c := range checks {
			out[i] = Verdict{
				Allowed:    true,
				Max:        c.Limit.Max,
				Remaining:  c.Limit.Max,
				Reset:      now.Add(c.Limit.Window),
				StoreError: true,
			}
		}
		return nil
	case OnErrorDeny:
		return fmt.Errorf("redis store: %w", cause)
	default:
		err := s.local.Decide(ctx, checks, now, out)
		for i := range checks {
			out[i].StoreError = true
		}
		return err
	}
}

// OnError returns what the store does when Redis fails.
func (s *RedisStore) OnError() string { return *s.onError.Load() }

// Configure implements Store: the decisions' timeout and on_error mode,
// the bound on the in-process state, and the zone's limits, so that Forget
// reaches a key in each and Range reports each key's window as its limit
// counts it. The local fallback store is configured alike.
func (s *RedisStore) Configure(st Settings) {
	s.SetMaxTracked(st.MaxTracked)
	s.SetTimeout(st.Timeout)
	s.SetOnError(st.OnError)
	s.SetLimits(st.Limits)
	s.local.Configure(st)
}

// SetLimits tells the store the zone's limits (Slot, Name and Limit of
// each; Key is not read).
func (s *RedisStore) SetLimits(limits []Check) {
	cp := slices.Clone(limits)
	s.limits.Store(&cp)
}

// zoneLimits returns what SetLimits gave, or the first limit alone.
func (s *RedisStore) zoneLimits() []Check {
	if p := s.limits.Load(); p != nil {
		return *p
	}
	return []Check{{}}
}

// limitNamed returns the Limit of the zone's limit stored under name.
func (s *RedisStore) limitNamed(name string) (Limit, bool) {
	for _, c := range s.zoneLimits() {
		if c.Name == name {
			return c.Limit, true
		}
	}
	return Limit{}, false
}

// banScript records a violation and bans a key: see redis_ban.lua.
//
//go:embed redis_ban.lua
var banSource string

var banScript = redis.NewScript(banSource)

// Ban implements Store: the ban holds on every instance sharing the
// Redis, and this one refuses the key locally until it ends.
func (s *RedisStore) Ban(ctx context.Context, c Check, now time.Time) (time.Time, error) {
	if c.Limit.Ban <= 0 {
		return time.Time{}, nil
	}
	s.markUsed()
	if s.sync != nil {
		return s.banSync(c, now), nil
	}
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	base := s.base(c.Name, s.tag(c.Key))
	ms, err := banScript.Run(ctx, s.client, []string{base + "b", base + "s", base + "r"},
		c.Limit.Ban.Milliseconds(), c.Limit.BanMax.Milliseconds()).Int64()
	if err != nil {
		return time.Time{}, fmt.Errorf("banning redis key %q: %w", base+"b", err)
	}
	until := now.Add(time.Duration(ms) * time.Millisecond)
	s.refused.put(cacheKey(c.Name, c.Key), until.UnixNano(), c.Limit.Max, false, now.UnixNano())
	return until, nil
}

// Interface guards
var _ Syncer = (*RedisStore)(nil)
