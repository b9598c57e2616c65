package limiter

import (
	"context"
	_ "embed"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
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

// RedisStoreOptions configure a RedisStore or a SyncStore.
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
	// Sync is a SyncStore's interval: every Sync it sends the counts of
	// the keys it touched and reads the fleet's back (redis_sync.lua).
	// NewSyncStore needs it positive; NewRedisStore does not read it, nor
	// SyncSpend and SyncTimeout.
	Sync time.Duration
	// SyncSpend is SyncShare (default) or SyncAll.
	SyncSpend string
	// SyncTimeout bounds each of sync mode's round trips, apart from a
	// decision's Timeout: a round of thousands of keys on a busy host
	// takes longer than one decision. Default: DefaultSyncTimeout.
	SyncTimeout time.Duration
	// Clock is the time the store reads outside Redis (the sync rounds
	// and table, probes, counts; the decisions take theirs from the
	// caller). Default: clock.Real.
	Clock clock.Clock
}

// redisCore is what the exact store (RedisStore) and the sync store
// (SyncStore) share: the client and its warm-up, the names of the zone's
// keys, the zone's limits, the health state machine and its probes, the
// unblock channel, the listing and the counts of the zone's keys, and the
// WebSocket leases. Each store embeds one and is its owner: the core asks
// it for what only the store knows (owner).
type redisCore struct {
	client  redis.UniversalClient
	warm    *Warmup // the client's first contact, which the first decisions wait for
	prefix  string
	hashKey []byte
	timeout atomic.Int64 // time.Duration
	onError atomic.Pointer[string]
	limits  atomic.Pointer[[]Check] // the zone's limits (Configure)
	used    chan struct{}           // closed at the first decision or unblock
	useOnce sync.Once
	logger  *zap.Logger
	clock   clock.Clock

	state      atomic.Int32
	streak     atomic.Int32 // consecutive failures when healthy, successes when recovering
	wake       chan struct{}
	probeEvery time.Duration

	counts keyCounter    // the counts of the zone's keys (CountKeys)
	watch  overrideWatch // told when the zone's overrides change (WatchOverrides)
	flying flyingLeases  // the leases of this instance's requests in flight

	owner redisOwner
}

// redisOwner is what the core asks of the store that embeds it.
type redisOwner interface {
	// probeOnce runs one health probe through the decisions' own path.
	probeOnce(ctx context.Context) error
	// recovered is told that Redis answers again after the store was
	// DEGRADED, and subscribed of each subscription to the unblock
	// channel, the first included: either way Redis may have lost what
	// it held, and unblocks may have gone unheard.
	recovered()
	subscribed(ctx context.Context)
	// Range is the store's (Store.Range), which counts walk.
	Range(ctx context.Context, now time.Time, fn func(KeyState) bool) error
	// dropCached drops from the in-process state the named limit's key
	// whose tag (the key, or its hash) is tag: an instance unblocked it.
	dropCached(name, tag string)
}

// init readies the core of a store owned by owner, completing opts with
// the defaults.
func (s *redisCore) init(opts *RedisStoreOptions, owner redisOwner) {
	if opts.MaxTracked <= 0 {
		opts.MaxTracked = DefaultMaxTracked
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Warmup == nil {
		opts.Warmup = NewWarmup(opts.Client)
	}
	if opts.Clock == nil {
		opts.Clock = clock.Real
	}
	s.client, s.warm, s.owner, s.clock = opts.Client, opts.Warmup, owner, opts.Clock
	s.prefix, s.hashKey, s.logger = opts.Prefix, opts.HashKey, opts.Logger
	s.wake, s.used = make(chan struct{}, 1), make(chan struct{})
	s.probeEvery = defaultProbeEvery
	s.counts.init(s.clock)
	s.SetTimeout(opts.Timeout)
	s.SetOnError(opts.OnError)
}

// SetTimeout changes the bound on each decision's round trip; a non-positive
// one restores the default of 100ms.
func (s *redisCore) SetTimeout(d time.Duration) {
	if d <= 0 {
		d = DefaultTimeout
	}
	s.timeout.Store(int64(d))
}

// SetOnError changes what the store does when Redis fails: OnErrorLocal (also
// for ""), OnErrorAllow or OnErrorDeny.
func (s *redisCore) SetOnError(mode string) {
	if mode == "" {
		mode = OnErrorLocal
	}
	s.onError.Store(&mode)
}

// OnError returns what the store does when Redis fails.
func (s *redisCore) OnError() string { return *s.onError.Load() }

// configure takes what every Redis store runs with of st: the decisions'
// timeout and on_error mode, and the zone's limits, so that Forget reaches
// a key in each and Range reports each key's window as its limit counts
// it.
func (s *redisCore) configure(st Settings) {
	s.SetTimeout(st.Timeout)
	s.SetOnError(st.OnError)
	s.SetLimits(st.Limits)
	s.flying.ttl.Store(int64(st.LeaseTTL))
}

// SetLimits tells the store the zone's limits (Slot, Name and Limit of
// each; Key is not read).
func (s *redisCore) SetLimits(limits []Check) {
	cp := slices.Clone(limits)
	s.limits.Store(&cp)
}

// zoneLimits returns what SetLimits gave, or the first limit alone.
func (s *redisCore) zoneLimits() []Check {
	if p := s.limits.Load(); p != nil {
		return *p
	}
	return []Check{{}}
}

// limitNamed returns the Limit of the zone's limit stored under name.
func (s *redisCore) limitNamed(name string) (Limit, bool) {
	for _, c := range s.zoneLimits() {
		if c.Name == name {
			return c.Limit, true
		}
	}
	return Limit{}, false
}

// slowTimeout bounds one step of work no request waits on (a flush, a
// Range page, a Forget): the decision timeout, but at least a second.
func (s *redisCore) slowTimeout() time.Duration {
	return max(time.Duration(s.timeout.Load()), time.Second)
}

// HashedKeys implements Store: whether keys are stored as HMAC hashes, so
// that Range lists hashes rather than client keys.
func (s *redisCore) HashedKeys() bool { return s.hashKey != nil }

// RangeLen implements Store: Redis's keys are counted only by walking
// them.
func (s *redisCore) RangeLen() (int, bool) { return 0, false }

// Evictions implements Store: Redis evicts nothing of the zone's (its
// maxmemory policy aside).
func (s *redisCore) Evictions() uint64 { return 0 }

// banScript records a violation and bans a key: see redis_ban.lua.
//
//go:embed redis_ban.lua
var banSource string

var banScript = redis.NewScript(banSource)
