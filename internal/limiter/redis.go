package limiter

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// hitScript is one decision over one or more limits, fixed or sliding: see
// redis.lua. Run sends it by EVALSHA and loads it on NOSCRIPT, so a
// restarted Redis costs one extra round trip.
//
//go:embed redis.lua
var hitSource string

var hitScript = redis.NewScript(hitSource)

// fixedScript decides the common case, one fixed window that does not ban,
// as hitScript would, in about half Redis's time: see redis_fixed.lua.
//
//go:embed redis_fixed.lua
var fixedSource string

var fixedScript = redis.NewScript(fixedSource)

// fixedOne reports whether a decision over checks is fixedScript's case.
func fixedOne(checks []Check) bool {
	if len(checks) != 1 {
		return false
	}
	l := &checks[0].Limit
	return !l.GCRA && !l.Sliding && l.Ban == 0
}

// releaseScript gives back what admitted requests spent: a Cluster
// decision's reservation in one slot, or a refund (see redis_release.lua).
//
//go:embed redis_release.lua
var releaseSource string

var releaseScript = redis.NewScript(releaseSource)

// banScript records a violation and bans a key: see redis_ban.lua.
//
//go:embed redis_ban.lua
var banSource string

var banScript = redis.NewScript(banSource)

// leaseScript takes, renews and gives back WebSocket leases: see
// redis_lease.lua.
//
//go:embed redis_lease.lua
var leaseSource string

var leaseScript = redis.NewScript(leaseSource)

// What a RedisStore does when Redis fails or is too slow to answer.
const (
	OnErrorLocal = "local" // keep limiting with an in-process store until Redis is back
	OnErrorAllow = "allow" // admit the request (fail open)
	OnErrorDeny  = "deny"  // refuse the request with 503 (fail closed)
)

// Health states of a RedisStore, as Health returns them.
const (
	HealthHealthy    = "HEALTHY"    // Redis answers; every decision goes to it
	HealthDegraded   = "DEGRADED"   // Redis failed repeatedly; decisions apply on_error without waiting on it
	HealthRecovering = "RECOVERING" // Redis answers again; decisions go to it until it has proved itself
)

const (
	stateHealthy = iota
	stateDegraded
	stateRecovering
)

var stateNames = [...]string{HealthHealthy, HealthDegraded, HealthRecovering}

// Tuning of the health state machine.
const (
	// degradeAfter consecutive failed decisions make a healthy store
	// degraded.
	degradeAfter = 3
	// recoverAfter consecutive successes (probes or decisions) make a
	// recovering store healthy.
	recoverAfter = 3
	// defaultProbeEvery is how often a degraded store probes Redis.
	defaultProbeEvery = 500 * time.Millisecond
	// probeTimeout is the least time a probe waits for its answer.
	probeTimeout = time.Second
	// refusedFlushEvery is how often the refusals answered from the
	// in-process cache are added to the refused tallies in Redis.
	refusedFlushEvery = time.Second
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
	s.local.SetMaxTracked(n)
	s.refused.setCap(n)
}

// slowTimeout bounds one step of work no request waits on (a flush, a
// Range page, a Forget): the decision timeout, but at least a second.
func (s *RedisStore) slowTimeout() time.Duration {
	return max(time.Duration(s.timeout.Load()), time.Second)
}

// Health returns HealthHealthy, HealthDegraded or HealthRecovering.
func (s *RedisStore) Health() string { return stateNames[s.state.Load()] }

// Healthy reports whether the store is HEALTHY, for the store health metric.
func (s *RedisStore) Healthy() bool { return s.state.Load() == stateHealthy }

// HashedKeys reports whether keys are stored as HMAC hashes, so that Range
// lists hashes rather than client keys.
func (s *RedisStore) HashedKeys() bool { return s.hashKey != nil }

// Hit implements Store. It returns an error only when Redis failed and
// on_error is deny; with allow or local the verdict has StoreError set.
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
	t := now.UnixNano()
	var resets [MaxChecks]int64
	cached := false
	for i := range checks {
		c := &checks[i]
		if reset, ok := s.refused.get(cacheKey(c.Name, c.Key), t, &c.Limit); ok {
			resets[i], cached = reset, true
		}
	}
	if cached {
		// Limits known to refuse: so is the request, with no round trip.
		// The others were not asked; their verdicts say only that.
		for i := range checks {
			c := &checks[i]
			out[i] = Verdict{Allowed: true, Max: c.Limit.Max, Remaining: c.Limit.Max, Reset: now.Add(c.Limit.Window)}
			if r := resets[i]; r != 0 {
				out[i] = Verdict{Max: c.Limit.Max, Reset: time.Unix(0, r), RetryAfter: time.Duration(r - t)}
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
			s.refused.put(cacheKey(c.Name, c.Key), t+int64(out[i].RetryAfter), c.Limit.Max, t)
		}
	}
	return nil
}

// cacheKey is a check's key in the refused cache: the client key for a
// zone's first limit, else the limit's name and the key.
func cacheKey(name, key string) string {
	if name == "" {
		return key
	}
	return name + "\x00" + key
}

// splitCacheKey undoes cacheKey.
func splitCacheKey(k string) (name, key string) {
	if name, key, ok := strings.Cut(k, "\x00"); ok {
		return name, key
	}
	return "", k
}

// keysPerCheck is how many Redis keys a check's decision touches: count,
// refused and previous count, and ban and strikes when its limit bans.
func keysPerCheck(c *Check) int {
	if c.Limit.Ban > 0 {
		return 5
	}
	return 3
}

// decisionDeadline is a context with a deadline that the decisions starting
// within one slice of the timeout share.
type decisionDeadline struct {
	ctx     context.Context
	cancel  context.CancelFunc // never called: the deadline releases the context
	timeout int64              // the timeout it was made for
	renew   time.Time          // from then a decision needs a new one (monotonic: a clock step cannot keep an expired one)
}

// deadlineSlices is how many contexts a timeout's span shares out: a
// decision's deadline comes at most a 64th of the timeout early.
const deadlineSlices = 64

// decisionCtx returns the context that bounds a decision starting now by
// the store's timeout. A context and a timer per decision (WithTimeout)
// cost about a tenth of Caddy's time for a Redis decision; decisions
// starting within a 64th of the timeout share one instead. It does not
// carry the request's cancellation: a request cancelled before its
// decision starts is not decided, one cancelled meanwhile is decided all
// the same, by its deadline at the latest.
func (s *RedisStore) decisionCtx() context.Context {
	now, timeout := time.Now(), s.timeout.Load()
	if d := s.deadline.Load(); d != nil && now.Before(d.renew) && d.timeout == timeout {
		return d.ctx
	}
	d := &decisionDeadline{timeout: timeout, renew: now.Add(time.Duration(timeout / deadlineSlices))}
	d.ctx, d.cancel = context.WithDeadline(context.Background(), now.Add(time.Duration(timeout)))
	s.deadline.Store(d)
	return d.ctx
}

// decideRedis runs the decision script for the checks: once, or on a
// Cluster once per slot they span (see Decide).
func (s *RedisStore) decideRedis(ctx context.Context, checks []Check, now time.Time, out []Verdict) error {
	if err := ctx.Err(); err != nil {
		return err // the client is gone: no decision to make
	}
	ctx = s.decisionCtx()
	if fixedOne(checks) {
		var buf [7]int64 // the reply, off the heap
		res, err := s.runCmd(ctx, fixedScript, s.fixedCmd(&checks[0], now), buf[:0])
		if err != nil {
			return err
		}
		return s.verdicts(checks, res, now, out)
	}
	var at [MaxChecks + 1]int // check i's keys are keys[at[i]:at[i+1]]
	for i := range checks {
		at[i+1] = at[i] + keysPerCheck(&checks[i])
	}
	// Sized to the checks: the keys escape to the heap with the call.
	keys := make([]string, at[len(checks)])
	for i := range checks {
		c := &checks[i]
		base := s.base(c.Name, s.tag(c.Key))
		k := keys[at[i]:]
		k[0], k[1], k[2] = base+"c", base+"r", base+"p"
		if c.Limit.Ban > 0 {
			k[3], k[4] = base+"b", base+"s"
		}
	}
	_, cluster := s.client.(*redis.ClusterClient)
	if !cluster || len(checks) == 1 {
		return s.runDecision(ctx, checks, keys, now, out)
	}
	// Group the checks by slot, in the order their slots first appear.
	var slotOf [MaxChecks]uint16
	for i := range checks {
		slotOf[i] = clusterSlot(keys[at[i]])
	}
	done := make([]bool, len(checks))
	var reserved [][]int // the checks of each slot that admitted
	admitted := true
	for i := range checks {
		if done[i] {
			continue
		}
		var idx []int
		for j := i; j < len(checks); j++ {
			if !done[j] && slotOf[j] == slotOf[i] {
				idx = append(idx, j)
				done[j] = true
			}
		}
		group := make([]Check, len(idx))
		gkeys := make([]string, 0, 5*len(idx))
		for k, j := range idx {
			group[k] = checks[j]
			gkeys = append(gkeys, keys[at[j]:at[j+1]]...)
		}
		gout := make([]Verdict, len(idx))
		if err := s.runDecision(ctx, group, gkeys, now, gout); err != nil {
			s.release(ctx, checks, reserved, nil, now)
			return err
		}
		slotAdmits := true
		for k, j := range idx {
			out[j] = gout[k]
			slotAdmits = slotAdmits && gout[k].Allowed
		}
		if !slotAdmits {
			// The request is refused. The other slots are still asked,
			// so that every limit that refuses tallies it and the
			// verdicts (and headers) are exact.
			admitted = false
			continue
		}
		reserved = append(reserved, idx)
	}
	if admitted {
		return nil
	}
	s.release(ctx, checks, reserved, nil, now)
	for i := range checks {
		c := &checks[i]
		if out[i].Allowed {
			out[i].Remaining = min(out[i].Remaining+int(c.cost()), c.Limit.Max) // its reservation was given back
		}
	}
	return nil
}

// release gives back what the checks of each group spent (each group's
// keys share a slot). verdicts, when given, are the checks' admitted
// verdicts: a GCRA bucket then gets back only what has not dripped back by
// now (gcraBack); without them, all of it (a reservation given back at
// once). It runs even when the decision's own deadline has passed (a slow
// slot is why a decision fails), with a deadline of its own. A failure is
// logged: the counts then stand until their windows end.
func (s *RedisStore) release(ctx context.Context, checks []Check, groups [][]int, verdicts []Verdict, now time.Time) {
	if len(groups) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.slowTimeout())
	defer cancel()
	for _, idx := range groups {
		keys := make([]string, 0, len(idx))
		args := make([]any, 0, 2*len(idx))
		for _, j := range idx {
			c := &checks[j]
			keys = append(keys, s.base(c.Name, s.tag(c.Key))+"c")
			if !c.Limit.GCRA {
				args = append(args, c.cost(), 0)
				continue
			}
			back := c.cost() * c.Limit.interval()
			if verdicts != nil {
				back = gcraBack(c, verdicts[j], now)
			}
			args = append(args, 0, max(back/int64(time.Microsecond), 1))
		}
		if err := releaseScript.Run(ctx, s.client, keys, args...).Err(); err != nil {
			s.logger.Warn("giving back a request's counts", zap.Strings("keys", keys), zap.Error(err))
		}
	}
}

// gcraBack returns what a GCRA request admitted with verdict v still holds
// of its bucket at now: its cost in time, less what has dripped back since
// (the bucket it left behind empties at v.Reset).
func gcraBack(c *Check, v Verdict, now time.Time) int64 {
	return min(c.cost()*c.Limit.interval(), max(int64(v.Reset.Sub(now)), 0))
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

// runDecision runs the decision script once for checks, whose keys (those
// keysPerCheck counts for each, in order) share one slot.
func (s *RedisStore) runDecision(ctx context.Context, checks []Check, keys []string, now time.Time, out []Verdict) error {
	// Sized to the checks: the arguments escape to the heap with the call.
	args := make([]any, 7*len(checks))
	for i := range checks {
		c := &checks[i]
		mode, burst := 0, 0
		switch {
		case c.Limit.GCRA:
			mode, burst = 2, int(c.Limit.burst())
		case c.Limit.Sliding:
			mode = 1
		}
		a := args[7*i : 7*i+7]
		a[0], a[1], a[2], a[3] = c.Limit.Max, c.Limit.Window.Milliseconds(), c.Limit.cutoffIn(now).Milliseconds(), mode
		a[4], a[5], a[6] = c.cost(), burst, ""
		if c.Limit.Ban > 0 {
			noBan := ":0"
			if c.NoBan {
				noBan = ":1"
			}
			a[6] = strconv.FormatInt(c.Limit.Ban.Milliseconds(), 10) + ":" + strconv.FormatInt(c.Limit.BanMax.Milliseconds(), 10) + noBan
		}
	}
	res, err := s.runScript(ctx, hitScript, keys, args)
	if err != nil {
		return err
	}
	return s.verdicts(checks, res, now, out)
}

// verdicts reads the checks' verdicts from a decision script's results, 7
// per check (see redis.lua).
func (s *RedisStore) verdicts(checks []Check, res []int64, now time.Time, out []Verdict) error {
	if len(res) != 7*len(checks) {
		return fmt.Errorf("redis store: decision script returned %d values, want %d", len(res), 7*len(checks))
	}
	t := now.UnixNano()
	// A bucket's times count from when Redis ran the script, after now:
	// from the reply, they are late rather than early, so that a refund
	// (gcraBack) never leaves a sliver of the request behind.
	replied := time.Now()
	for i := range checks {
		c := &checks[i]
		r := res[7*i : 7*i+7]
		left := time.Duration(r[2]) * time.Millisecond
		v := Verdict{
			Allowed:   r[0] == 1 && r[6] <= 0,
			Max:       c.Limit.Max,
			Remaining: int(max(int64(c.Limit.Max)-r[1], 0)),
			Reset:     now.Add(left),
		}
		reset := t + int64(left)
		switch {
		case c.Limit.GCRA:
			v.Remaining = int(max(c.Limit.burst()-r[1], 0))
			v.Reset = replied.Add(left)
		case c.Limit.Sliding:
			v.Remaining = int(max(float64(c.Limit.Max)-math.Ceil(c.Limit.sliding(r[4], r[1], reset, t)), 0))
		}
		if r[0] == 0 {
			v.RetryAfter = left
			switch {
			case r[5] > 0:
				v.RetryAfter = max(time.Duration(r[5])*time.Millisecond, time.Millisecond)
			case c.Limit.Sliding:
				v.RetryAfter = max(c.Limit.slidingWait(r[4], r[1], reset, t, c.cost()), time.Millisecond)
			}
		}
		if !v.Allowed {
			v.FirstRefusal = r[3] == 1
			v.PendingBan = r[6] < 0
		}
		if r[6] > 0 {
			// Refused until the ban ends, and the window admits.
			v.RetryAfter = max(v.RetryAfter, time.Duration(r[6])*time.Millisecond)
			v.Remaining = 0
			v.Reset = now.Add(v.RetryAfter)
		}
		out[i] = v
	}
	return nil
}

// pipelineQueue bounds the decisions queued in the auto-pipeliner: past
// it, a decision fails at once (and on_error decides it).
const pipelineQueue = 10_000

// runScript runs a script with keys and args, through the auto-pipeliner
// when the store has one.
func (s *RedisStore) runScript(ctx context.Context, script *redis.Script, keys []string, args []any) ([]int64, error) {
	full := make([]any, 0, 3+len(keys)+len(args))
	full = append(full, "evalsha", script.Hash(), len(keys))
	for _, k := range keys {
		full = append(full, k)
	}
	return s.runCmd(ctx, script, append(full, args...), nil)
}

// fixedHash is fixedScript's SHA1, boxed once for every command.
var fixedHash any = fixedScript.Hash()

// fixedCmd returns the EVALSHA command of fixedScript for check c at now.
// It allocates what it must: the two keys in one string, and the arguments
// with the keys' headers, which the arguments hold as *string (go-redis
// writes them, and finds a Cluster slot from them, as strings) so that they
// are not boxed one by one. The limit's max and window are boxed once per
// limit.
func (s *RedisStore) fixedCmd(c *Check, now time.Time) []any {
	tag := s.tag(c.Key)
	k := make([]byte, 0, 2*(baseLen(s.prefix, c.Name, tag)+1))
	k = append(s.appendBase(k, c.Name, tag), 'c')
	n := len(k)
	// The refused key: the same base again.
	k = append(append(k, k[:n-1]...), 'r')
	keys := unsafe.String(unsafe.SliceData(k), len(k)) // k is not written again
	b := s.boxedLimit(&c.Limit)
	var cutoff any = b.windowAny
	if ms := c.Limit.cutoffIn(now).Milliseconds(); ms != b.window {
		cutoff = ms // a reload shortened the window
	}
	a := new(fixedArgs)
	a.keys = [2]string{keys[:n], keys[n:]}
	a.args = [...]any{"evalsha", fixedHash, 2, &a.keys[0], &a.keys[1], b.maxAny, b.windowAny, cutoff, c.cost()}
	return a.args[:]
}

// fixedArgs is fixedCmd's command in one allocation: its arguments, and the
// two keys they point to.
type fixedArgs struct {
	args [9]any
	keys [2]string
}

// boxedLimit is a limit's max and window in milliseconds, boxed as script
// arguments.
type boxedLimit struct {
	max, window       int64
	maxAny, windowAny any
}

// boxedLimit returns l's max and window boxed: the last limit's, kept,
// when l is the same.
func (s *RedisStore) boxedLimit(l *Limit) *boxedLimit {
	w := l.Window.Milliseconds()
	if b := s.boxed.Load(); b != nil && b.max == int64(l.Max) && b.window == w {
		return b
	}
	b := &boxedLimit{max: int64(l.Max), window: w, maxAny: int64(l.Max), windowAny: w}
	s.boxed.Store(b)
	return b
}

// runCmd runs script's EVALSHA command full ("evalsha", its hash, the
// number of keys, the keys, the arguments), through the auto-pipeliner
// when the store has one; when Redis lacks the script (NOSCRIPT, after a
// restart) it loads it and sends the command again. The script's integers
// are appended to into[:0].
func (s *RedisStore) runCmd(ctx context.Context, script *redis.Script, full []any, into []int64) ([]int64, error) {
	cmd, err := s.send(ctx, full)
	// HasErrorPrefix allocates even for nil: it is asked only on an error.
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		if err = script.Load(ctx, s.client).Err(); err == nil {
			cmd, err = s.send(ctx, full)
		}
	}
	if err != nil {
		return nil, err
	}
	vals, err := cmd.Slice()
	if err != nil {
		return nil, err
	}
	res := into[:0]
	for _, v := range vals {
		n, ok := v.(int64)
		if !ok {
			return nil, fmt.Errorf("redis store: script reply holds %T, not an integer", v)
		}
		res = append(res, n)
	}
	return res, nil
}

// send sends the command full, its first key at index 3, through the
// auto-pipeliner when the store has one.
func (s *RedisStore) send(ctx context.Context, full []any) (*redis.Cmd, error) {
	cmd := redis.NewCmd(ctx, full...)
	cmd.SetFirstKeyPos(3) // the first key, for a Cluster's slot
	if s.pipe == nil {
		return cmd, s.client.Process(ctx, cmd)
	}
	if err := ctx.Err(); err != nil {
		return nil, err // once queued, the command would run all the same
	}
	return cmd, s.pipe.Submit(ctx, cmd).WaitContext(ctx)
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

// failed records a failed decision.
func (s *RedisStore) failed(err error) {
	switch s.state.Load() {
	case stateHealthy:
		if s.streak.Add(1) >= degradeAfter {
			s.transition(stateHealthy, stateDegraded, err)
		}
	case stateRecovering:
		s.transition(stateRecovering, stateDegraded, err)
	}
}

// succeeded records a successful round trip.
func (s *RedisStore) succeeded() {
	switch s.state.Load() {
	case stateHealthy:
		if s.streak.Load() != 0 {
			s.streak.Store(0)
		}
	case stateRecovering:
		if s.streak.Add(1) >= recoverAfter {
			s.transition(stateRecovering, stateHealthy, nil)
		}
	}
}

// transition moves the store from one health state to another, if it is
// still in from, and logs the change once.
func (s *RedisStore) transition(from, to int32, cause error) {
	if !s.state.CompareAndSwap(from, to) {
		return
	}
	s.streak.Store(0)
	fields := []zap.Field{zap.String("from", stateNames[from]), zap.String("to", stateNames[to]), zap.String("prefix", s.prefix)}
	switch to {
	case stateDegraded:
		s.logger.Warn("redis store degraded: deciding without redis, as on_error says, until it answers again",
			append(fields, zap.String("on_error", *s.onError.Load()), zap.Error(cause))...)
		select {
		case s.wake <- struct{}{}:
		default:
		}
	case stateRecovering:
		s.logger.Info("redis store recovering: redis answers again", fields...)
	case stateHealthy:
		s.logger.Info("redis store healthy", fields...)
	}
}

// Run probes Redis whenever the store is degraded, until it is healthy
// again, adds the refusals answered in-process to the tallies in Redis every
// second while it is not degraded, runs the counts CountKeys asks for, and
// sweeps the local fallback store every interval(); it returns when ctx is
// done.
func (s *RedisStore) Run(ctx context.Context, interval func() time.Duration) {
	go s.local.RunSweeper(ctx, interval)
	go func() {
		// Nothing connects before the store is used: a config that is
		// only validated never subscribes.
		select {
		case <-ctx.Done():
			return
		case <-s.used:
		}
		s.listen(ctx)
	}()
	tick := time.NewTicker(refusedFlushEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
			s.probe(ctx)
		case <-s.counts.ask:
			// In its own goroutine: a count takes seconds on a large
			// zone, and the refusals are flushed meanwhile.
			go s.count(ctx)
		case <-tick.C:
			if s.state.Load() != stateDegraded {
				fctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
				if err := s.flushRefused(fctx, time.Now()); err != nil {
					s.logger.Debug("adding cached refusals to redis", zap.Error(err))
				}
				cancel()
			}
		}
	}
}

// Lease is one open WebSocket's hold on its key's share of a socket cap
// that every instance sharing the Redis counts together. Its zero value holds
// nothing.
type Lease struct {
	key, id string
}

// AcquireLease takes one of key's at most maxOpen leases for ttl, unless
// key holds maxOpen unexpired leases already (ok false). Keep it with
// RenewLease more often than ttl and give it back with ReleaseLease; the
// lease of an instance that dies lapses after ttl. An error means Redis did
// not answer (the caller falls back as on_error says).
func (s *RedisStore) AcquireLease(ctx context.Context, key string, maxOpen int, ttl time.Duration) (Lease, bool, error) {
	s.awaitWarm(ctx)
	ctx, cancel := context.WithTimeout(ctx, time.Duration(s.timeout.Load()))
	defer cancel()
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return Lease{}, false, err
	}
	l := Lease{key: s.base("", s.tag(key)) + "ws", id: hex.EncodeToString(b[:])}
	n, err := leaseScript.Run(ctx, s.client, []string{l.key}, "acquire", l.id, ttl.Milliseconds(), maxOpen).Int()
	if err != nil {
		// The script may have run with its reply lost: give the lease
		// back rather than let it hold a place until it lapses.
		go func() { _ = s.ReleaseLease(context.Background(), l) }()
		return Lease{}, false, err
	}
	return l, n == 1, nil
}

// RenewLease extends l by ttl from now. A lease Redis lost (a failover, a
// restart) is taken again, over the cap if need be, since its socket still
// lives; lost reports that.
func (s *RedisStore) RenewLease(ctx context.Context, l Lease, ttl time.Duration) (lost bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	n, err := leaseScript.Run(ctx, s.client, []string{l.key}, "renew", l.id, ttl.Milliseconds(), 0).Int()
	return n == 2, err
}

// Degraded reports whether the store is DEGRADED: it does not wait on Redis.
func (s *RedisStore) Degraded() bool { return s.state.Load() == stateDegraded }

// ReleaseLease gives l back.
func (s *RedisStore) ReleaseLease(ctx context.Context, l Lease) error {
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	return leaseScript.Run(ctx, s.client, []string{l.key}, "release", l.id, 0, 0).Err()
}

// OnError returns what the store does when Redis fails.
func (s *RedisStore) OnError() string { return *s.onError.Load() }

// unblockChannel is the Redis channel on which the instances sharing the
// zone announce the keys an unblock forgot, so that each drops them from its
// in-process caches at once rather than when their windows would end.
func (s *RedisStore) unblockChannel() string { return s.prefix + "unblocked" }

// listen drops from the in-process caches every key another instance (or
// this one) announces as unblocked, until ctx is done. The client
// resubscribes after a lost connection by itself; announcements made while
// not subscribed are lost, so on every subscription, the first included,
// the refused cache is emptied: the next decision of each key goes to
// Redis, which is never stale.
func (s *RedisStore) listen(ctx context.Context) {
	ps := s.client.Subscribe(ctx, s.unblockChannel())
	// Receive does not return when ctx ends: closing the subscription
	// makes it.
	stop := context.AfterFunc(ctx, func() { _ = ps.Close() })
	defer stop()
	defer ps.Close()
	failing := false
	for {
		msg, err := ps.Receive(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if !failing {
				// Once per outage: a NOPERM (a Redis user without
				// channel rights) would otherwise fail silently.
				s.logger.Warn("unblock channel: other instances' unblocks are not heard until it works again",
					zap.String("channel", s.unblockChannel()), zap.Error(err))
				failing = true
			}
			select { // the next Receive reconnects; do not spin while Redis is away
			case <-ctx.Done():
				return
			case <-time.After(s.probeEvery):
			}
			continue
		}
		failing = false
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" {
				// What was cached before this (re)subscription may have
				// been unblocked unheard. Its pending refusal tallies go
				// to Redis first.
				fctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
				_ = s.flushRefused(fctx, time.Now())
				cancel()
				s.refused.forgetFunc(func(string) bool { return true })
			}
		case *redis.Message:
			name, tag, _ := strings.Cut(m.Payload, "\x00")
			s.dropCached(name, tag)
		}
	}
}

// dropCached drops the key whose tag (the key, or its hash) is tag from the
// named limit's refused cache and from the local fallback store.
func (s *RedisStore) dropCached(name, tag string) {
	if s.hashKey == nil {
		s.refused.forget(cacheKey(name, tag))
		for slot := range MaxChecks {
			if s.local.slotName(slot) == name {
				_, _ = s.local.ForgetCheck(context.Background(), Check{Slot: slot, Key: tag})
			}
		}
		return
	}
	s.refused.forgetFunc(func(k string) bool {
		n, key := splitCacheKey(k)
		return n == name && s.tag(key) == tag
	})
}

// flushRefused adds the refusals the in-process cache answered since the
// last flush to the keys' refused tallies in Redis, so that the admin
// listing (of any instance) counts every refused request, not only the
// first of each window. The tally expires with the window the cache entry
// belongs to; entries whose window has reset at now are dropped. Counts
// whose write fails are dropped too: they are statistics, never verdicts.
func (s *RedisStore) flushRefused(ctx context.Context, now time.Time) error {
	pending := s.refused.drain()
	// Plain pipelines of flushPage keys, not one MULTI/EXEC: a transaction
	// over a flood of keys would hold Redis for every other client until it
	// ran to the end. An INCRBY whose PEXPIRE is lost with its connection
	// leaves a tally without expiry until the key's next refusal sets one.
	// The expiry is relative, so the local clock need not agree with
	// Redis's.
	var errs []error
	for len(pending) > 0 {
		page := pending[:min(len(pending), flushPage)]
		pending = pending[len(page):]
		pipe := s.client.Pipeline()
		for _, p := range page {
			ttl := time.Duration(p.reset - now.UnixNano())
			if ttl < time.Millisecond {
				continue
			}
			name, key := splitCacheKey(p.key)
			k := s.base(name, s.tag(key)) + "r"
			pipe.IncrBy(ctx, k, int64(p.n))
			pipe.PExpire(ctx, k, ttl)
		}
		if pipe.Len() == 0 {
			continue
		}
		if _, err := pipe.Exec(ctx); err != nil {
			errs = append(errs, err)
			if ctx.Err() != nil {
				break
			}
		}
	}
	return errors.Join(errs...)
}

// flushPage is how many keys one pipeline of flushRefused writes.
const flushPage = 500

// probe runs probeOnce every probeEvery until the store is healthy or ctx
// is done.
func (s *RedisStore) probe(ctx context.Context) {
	timer := time.NewTimer(s.probeEvery)
	defer timer.Stop()
	for s.state.Load() != stateHealthy {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		// A probe keeps no request waiting, so it may take longer than a
		// decision: after a restart it must dial (and maybe handshake TLS
		// and authenticate) before its script runs.
		pctx, cancel := context.WithTimeout(ctx, max(time.Duration(s.timeout.Load()), probeTimeout))
		err := s.probeOnce(pctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			s.failed(err)
		case s.state.Load() == stateDegraded:
			s.transition(stateDegraded, stateRecovering, nil)
			s.succeeded()
		default:
			s.succeeded()
		}
		timer.Reset(s.probeEvery)
	}
}

// probeTag names the key the probe decides on. No client key has this form
// (client keys are addresses or start with "key:"; hashed ones are hex), and
// Range skips it.
const probeTag = "__probe"

// probeOnce runs both decision scripts on the probe key, with a limit no
// probe reaches and a one-second window. A PING would answer while decisions still
// fail (out of memory, a read-only replica, a script error), and the store
// would cycle between degraded and recovering.
func (s *RedisStore) probeOnce(ctx context.Context) error {
	base := s.base("", probeTag)
	// The decisions' own path (the auto-pipeliner, when on): a probe
	// through another connection would call a Redis healthy that the
	// decisions still cannot reach.
	_, err := s.runScript(ctx, hitScript, []string{base + "c", base + "r", base + "p"}, []any{1 << 30, 1000, 1000, 0, 1, 0, ""})
	if err == nil {
		_, err = s.runScript(ctx, fixedScript, []string{base + "c", base + "r"}, []any{1 << 30, 1000, 1000, 1})
	}
	return err
}

// Tag returns what names key in Redis and in the store's listing: the
// key itself, or with HashKey its HMAC in hex.
func (s *RedisStore) Tag(key string) string { return s.tag(key) }

// tag returns the part of the Redis keys that names the client: the key
// itself, or its HMAC in hex.
func (s *RedisStore) tag(key string) string {
	if s.hashKey == nil {
		return key
	}
	m := hmac.New(sha256.New, s.hashKey)
	m.Write([]byte(key))
	return hex.EncodeToString(m.Sum(nil))
}

// base returns the Redis key of a client tag in the named limit without its
// last letter ("c" for the count, "r" for the refused tally). The tag is a
// Cluster hash tag, so both keys of a client map to one slot, and so do the
// keys of one client in every limit. A zone's first limit (name "") has no
// name in its keys.
func (s *RedisStore) base(name, tag string) string {
	b := s.appendBase(make([]byte, 0, baseLen(s.prefix, name, tag)), name, tag)
	return unsafe.String(unsafe.SliceData(b), len(b)) // b is not written again
}

// baseLen is the length of base(name, tag) with prefix.
func baseLen(prefix, name, tag string) int {
	n := len(prefix) + len(tag) + 3 // {tag}:
	if name != "" {
		n += len(name) + 2 // @name:
	}
	return n
}

// appendBase appends base(name, tag) to b.
func (s *RedisStore) appendBase(b []byte, name, tag string) []byte {
	b = append(b, s.prefix...)
	if name != "" {
		b = append(b, '@')
		b = append(b, name...)
		b = append(b, ':')
	}
	b = append(b, '{')
	b = append(b, tag...)
	return append(b, "}:"...)
}

// parseKey splits a count or ban key the store wrote into the limit name
// and the tag; ok is false for a key of another zone whose name the prefix starts.
func (s *RedisStore) parseKey(k string) (name, tag string, ok bool) {
	rest, ok := strings.CutPrefix(k, s.prefix)
	if !ok {
		return "", "", false
	}
	if after, isNamed := strings.CutPrefix(rest, "@"); isNamed {
		i := strings.Index(after, ":{")
		if i < 0 {
			return "", "", false
		}
		name, rest = after[:i], after[i+1:]
	}
	if !strings.HasPrefix(rest, "{") || !(strings.HasSuffix(rest, "}:c") || strings.HasSuffix(rest, "}:b")) {
		return "", "", false
	}
	return name, rest[1 : len(rest)-3], true
}

// SetSlotName names the limit counted in slot of the in-process fallback
// store (see MemoryStore.SetSlotName).
func (s *RedisStore) SetSlotName(slot int, name string) { s.local.SetSlotName(slot, name) }

// SetLimits tells the store the zone's limits (Slot, Name and Limit of
// each; Key is not read), so that Forget reaches a key in each and Range
// reports each key's window as the limit counts it.
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

// clusterSlot returns the Redis Cluster slot of key: CRC16 (XMODEM) of its
// hash tag, or of the whole key when it has none, modulo 16384.
func clusterSlot(key string) uint16 {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for k := 0; k < len(key); k++ {
		crc ^= uint16(key[k]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return crc % 16384
}

// Len implements Store. Counters in Redis are counted only by walking them
// (CountKeys); Len returns the keys tracked in this process by the local
// fallback store.
func (s *RedisStore) Len() int { return s.local.Len() }

// Range implements Store. It walks the zone's count keys with SCAN (on every
// master of a Cluster), a page at a time, never KEYS, and reads each page's
// counts and expiries in one pipeline. With hashed keys, KeyState.Key is the
// hash (see HashedKeys).
func (s *RedisStore) Range(ctx context.Context, now time.Time, fn func(KeyState) bool) error {
	fctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	err := s.flushRefused(fctx, now)
	cancel()
	if err != nil {
		return fmt.Errorf("adding cached refusals to redis: %w", err)
	}
	// ForEachMaster scans a Cluster's masters concurrently: fn is called
	// one at a time all the same.
	var mu sync.Mutex
	stopped := false
	call := func(ks KeyState) bool {
		mu.Lock()
		defer mu.Unlock()
		if stopped {
			return false
		}
		stopped = !fn(ks)
		return !stopped
	}
	err = s.forEachNode(ctx, func(ctx context.Context, c scanner) error {
		return s.scan(ctx, c, now, call)
	})
	if errors.Is(err, errStopRange) {
		return nil
	}
	return err
}

// errStopRange ends a scan when the Range callback returns false.
var errStopRange = errors.New("range stopped")

// scanner is what Range needs of a Redis client or Cluster node.
type scanner interface {
	Scan(ctx context.Context, cursor uint64, match string, count int64) *redis.ScanCmd
	Pipeline() redis.Pipeliner
}

// scanPage is how many keys one SCAN step asks for.
const scanPage = 500

// scan calls fn for each live count key of the zone on one Redis node.
func (s *RedisStore) scan(ctx context.Context, c scanner, now time.Time, fn func(KeyState) bool) error {
	return s.scanPages(ctx, c, "[cb]", func(ctx context.Context, keys []string) error {
		return s.readPage(ctx, c, keys, now, fn)
	})
}

// forEachNode calls fn with the client, or with each master of a Cluster
// (concurrently).
func (s *RedisStore) forEachNode(ctx context.Context, fn func(ctx context.Context, c scanner) error) error {
	if cc, ok := s.client.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return fn(ctx, c) })
	}
	return fn(ctx, s.client)
}

// CutWindows ends every window of the limit c names (its Slot and Name)
// that would end after cutoff at cutoff, in Redis and in the local caches: a
// reload shortened the limit's window. It scans the zone's keys a page at a
// time and sets each page's expiries in one pipeline with PEXPIRE … LT
// (Redis 7), which never lengthens one.
func (s *RedisStore) CutWindows(ctx context.Context, c Check, cutoff time.Time) error {
	s.refused.forgetAfter(cutoff.UnixNano())
	s.local.CutWindows(c.Slot, cutoff)
	return s.forEachNode(ctx, func(ctx context.Context, node scanner) error {
		return s.scanPages(ctx, node, "c", func(ctx context.Context, keys []string) error {
			keys = slices.DeleteFunc(keys, func(k string) bool {
				name, _, ok := s.parseKey(k)
				return !ok || name != c.Name
			})
			ms := time.Until(cutoff).Milliseconds()
			pipe := node.Pipeline()
			for _, k := range keys {
				if ms <= 0 {
					pipe.Del(ctx, k, strings.TrimSuffix(k, "c")+"r")
					continue
				}
				pipe.Do(ctx, "PEXPIRE", k, ms, "LT")
				pipe.Do(ctx, "PEXPIRE", strings.TrimSuffix(k, "c")+"r", ms, "LT")
			}
			if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
				return fmt.Errorf("cutting redis windows: %w", err)
			}
			return nil
		})
	})
}

// scanPages calls page with each page of the zone's keys of the kinds
// suffix matches (a glob: "c" for count keys, "[cb]" with ban keys) on one
// Redis node.
func (s *RedisStore) scanPages(ctx context.Context, c scanner, suffix string, page func(ctx context.Context, keys []string) error) error {
	pattern := escapeGlob(s.prefix) + "*{*}:" + suffix
	var cursor uint64
	for {
		// Each step has its own deadline: the client has no read timeout
		// (see StoreConfig.provision) and ctx may have none.
		sctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
		keys, next, err := c.Scan(sctx, cursor, pattern, scanPage).Result()
		if err == nil && len(keys) > 0 {
			err = page(sctx, keys)
		} else if err != nil {
			err = fmt.Errorf("scanning redis keys %q: %w", pattern, err)
		}
		cancel()
		if err != nil {
			return err
		}
		if next == 0 {
			return nil
		}
		cursor = next
	}
}

// readPage reads the count, expiry, refused tally and ban of a page of
// count and ban keys in one pipeline and passes the live ones to fn. A ban
// key is listed on its own only once its count key has gone (a ban outlives
// its window); before, the count key's row carries it.
func (s *RedisStore) readPage(ctx context.Context, c scanner, keys []string, now time.Time, fn func(KeyState) bool) error {
	type row struct {
		count, refused, prev *redis.StringCmd
		ttl, ban             *redis.DurationCmd
		counted              *redis.IntCmd
	}
	rows := make([]row, len(keys))
	pipe := c.Pipeline()
	for i, k := range keys {
		base := k[:len(k)-1]
		if strings.HasSuffix(k, "b") {
			rows[i] = row{ban: pipe.PTTL(ctx, k), counted: pipe.Exists(ctx, base+"c"), refused: pipe.Get(ctx, base+"r")}
			continue
		}
		rows[i] = row{
			count:   pipe.Get(ctx, k),
			ttl:     pipe.PTTL(ctx, k),
			refused: pipe.Get(ctx, base+"r"),
			prev:    pipe.Get(ctx, base+"p"),
			ban:     pipe.PTTL(ctx, base+"b"),
		}
	}
	// Exec returns the first command's error: one for a missing key, or a
	// damaged one (WRONGTYPE, see redis.lua), is that row's alone.
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) && !redis.HasErrorPrefix(err, "WRONGTYPE") {
		return fmt.Errorf("reading redis counters: %w", err)
	}
	for i, k := range keys {
		name, tag, ok := s.parseKey(k)
		if !ok || tag == probeTag {
			continue
		}
		refused, _ := rows[i].refused.Int()
		ban := rows[i].ban.Val()
		if rows[i].count == nil {
			if ban <= 0 || rows[i].counted.Val() > 0 {
				continue
			}
			until := now.Add(ban)
			if !fn(KeyState{Key: tag, Refused: refused, Reset: until, BannedUntil: until, Name: name}) {
				return errStopRange
			}
			continue
		}
		count, err := rows[i].count.Int()
		ttl := rows[i].ttl.Val()
		if err != nil || ttl <= 0 {
			continue // expired between SCAN and GET
		}
		prev, _ := rows[i].prev.Int()
		ks := KeyState{Key: tag, Count: count, Refused: refused, Prev: prev, Name: name}
		if l, ok := s.limitNamed(name); ok {
			switch {
			case l.GCRA:
				// The count key holds the theoretical arrival time; it
				// expires when the bucket is full again.
				ks.Count = 0
			case l.Sliding:
				// A sliding count outlives its window by a window, as the
				// next one's previous count (redis.lua): its window ends
				// a window before the key does. A ban outlives it too.
				if ttl -= l.Window; ttl <= 0 {
					if ban <= 0 {
						continue
					}
					until := now.Add(ban)
					if !fn(KeyState{Key: tag, Refused: refused, Reset: until, BannedUntil: until, Name: name}) {
						return errStopRange
					}
					continue
				}
			}
		}
		ks.Reset = now.Add(ttl)
		if ban > 0 {
			ks.BannedUntil = now.Add(ban)
		}
		if !fn(ks) {
			return errStopRange
		}
	}
	return nil
}

// Forget implements Store: it forgets key in every limit of the zone. key is
// a client key or, with hashed keys, the hash Range lists. The other Caddy
// instances sharing the Redis hear of it on the unblock channel (listen).
func (s *RedisStore) Forget(ctx context.Context, key string) (bool, error) {
	found := false
	for _, c := range s.zoneLimits() {
		ok, err := s.ForgetCheck(ctx, Check{Slot: c.Slot, Name: c.Name, Key: key})
		if err != nil {
			return found, err
		}
		found = found || ok
	}
	return found, nil
}

// markUsed records that the store is in use, which starts its
// subscription to the unblock channel (Run).
func (s *RedisStore) markUsed() { s.useOnce.Do(func() { close(s.used) }) }

// ForgetCheck implements Store.
func (s *RedisStore) ForgetCheck(ctx context.Context, c Check) (bool, error) {
	s.markUsed()
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	tags := []string{s.tag(c.Key)}
	if s.hashKey != nil && isHexHash(c.Key) {
		tags = append(tags, c.Key)
		s.refused.forgetFunc(func(k string) bool {
			name, key := splitCacheKey(k)
			return name == c.Name && s.tag(key) == c.Key
		})
	}
	s.refused.forget(cacheKey(c.Name, c.Key))
	_, _ = s.local.ForgetCheck(ctx, c)
	found := false
	for _, tag := range tags {
		base := s.base(c.Name, tag)
		// One DEL per tag: its keys share the tag's slot.
		n, err := s.client.Del(ctx, base+"c", base+"r", base+"p", base+"b", base+"s").Result()
		if err != nil {
			return found, fmt.Errorf("deleting redis key %q: %w", base+"c", err)
		}
		found = found || n > 0
		if n > 0 {
			// Every instance drops the key from its caches (listen).
			if err := s.client.Publish(ctx, s.unblockChannel(), c.Name+"\x00"+tag).Err(); err != nil {
				s.logger.Warn("announcing an unblock to the other instances", zap.Error(err))
			}
		}
	}
	return found, nil
}

// Ban implements Store: the ban holds on every instance sharing the
// Redis, and this one refuses the key locally until it ends.
func (s *RedisStore) Ban(ctx context.Context, c Check, now time.Time) (time.Time, error) {
	if c.Limit.Ban <= 0 {
		return time.Time{}, nil
	}
	s.markUsed()
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	base := s.base(c.Name, s.tag(c.Key))
	ms, err := banScript.Run(ctx, s.client, []string{base + "b", base + "s", base + "r"},
		c.Limit.Ban.Milliseconds(), c.Limit.BanMax.Milliseconds()).Int64()
	if err != nil {
		return time.Time{}, fmt.Errorf("banning redis key %q: %w", base+"b", err)
	}
	until := now.Add(time.Duration(ms) * time.Millisecond)
	s.refused.put(cacheKey(c.Name, c.Key), until.UnixNano(), c.Limit.Max, now.UnixNano())
	return until, nil
}

// isHexHash reports whether key looks like a hashed key: 64 hex digits.
func isHexHash(key string) bool {
	if len(key) != 2*sha256.Size {
		return false
	}
	_, err := hex.DecodeString(key)
	return err == nil
}

// escapeGlob escapes the characters SCAN MATCH treats as a pattern.
func escapeGlob(s string) string {
	var b strings.Builder
	for _, r := range s {
		switch r {
		case '*', '?', '[', ']', '\\':
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// refusedCache remembers the keys Redis refused until their window resets,
// so that they are refused again without a round trip. It is bounded: when
// a shard is full, expired entries are purged, and if it is still full the
// key is not cached (it just keeps going to Redis).
type refusedCache struct {
	seed     maphash.Seed
	shardCap atomic.Int64
	dirty    atomic.Bool // some entry has pending refusals
	shards   [16]refusedShard
}

type refusedShard struct {
	mu sync.Mutex
	m  map[string]refusedEntry
	_  [64]byte // keep neighbouring shards' locks off one cache line
}

// refusedEntry is one key known to be over its limit.
type refusedEntry struct {
	reset   int64 // Unix nanoseconds at which the window resets
	max     int   // the limit it is over: a raised limit ignores the entry
	pending int   // refusals answered from the cache, not yet tallied in Redis
}

// pendingRefusals are the refusals of one key that the cache answered and
// Redis has not counted yet.
type pendingRefusals struct {
	key   string
	reset int64
	n     int
}

func (c *refusedCache) init(maxKeys int) {
	c.seed = maphash.MakeSeed()
	for i := range c.shards {
		c.shards[i].m = make(map[string]refusedEntry)
	}
	c.setCap(maxKeys)
}

func (c *refusedCache) setCap(maxKeys int) {
	c.shardCap.Store(int64(max(maxKeys/len(c.shards), 1)))
}

func (c *refusedCache) shard(key string) *refusedShard {
	return &c.shards[maphash.String(c.seed, key)%uint64(len(c.shards))]
}

// get returns the reset time of key if it is known to be over limit at t,
// and then counts one refusal for drain.
func (c *refusedCache) get(key string, t int64, limit *Limit) (int64, bool) {
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.m[key]
	if !ok {
		return 0, false
	}
	// An entry that a shorter window cuts short (a reload shortened it)
	// goes: Redis, which cuts its window too, decides instead.
	if t >= e.reset || (limit.Ban == 0 && limit.End(e.reset, t) != e.reset) {
		delete(sh.m, key)
		return 0, false
	}
	if limit.Max > e.max {
		return 0, false
	}
	e.pending++
	sh.m[key] = e
	if !c.dirty.Load() { // a flood reads the flag, never writes it
		c.dirty.Store(true)
	}
	return e.reset, true
}

// drain returns the refusals counted by get since the last drain and
// zeroes them.
func (c *refusedCache) drain() []pendingRefusals {
	if !c.dirty.Swap(false) {
		return nil
	}
	var out []pendingRefusals
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if e.pending > 0 {
				out = append(out, pendingRefusals{key: k, reset: e.reset, n: e.pending})
				e.pending = 0
				sh.m[k] = e
			}
		}
		sh.mu.Unlock()
	}
	return out
}

// put records that key is over limitMax until reset.
func (c *refusedCache) put(key string, reset int64, limitMax int, t int64) {
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if int64(len(sh.m)) >= c.shardCap.Load() {
		for k, e := range sh.m {
			if t >= e.reset {
				delete(sh.m, k)
			}
		}
		if int64(len(sh.m)) >= c.shardCap.Load() {
			return
		}
	}
	sh.m[strings.Clone(key)] = refusedEntry{reset: reset, max: limitMax}
}

// forget drops key.
func (c *refusedCache) forget(key string) {
	sh := c.shard(key)
	sh.mu.Lock()
	delete(sh.m, key)
	sh.mu.Unlock()
}

// forgetAfter drops every key cached as refused past cutoff (Unix
// nanoseconds).
func (c *refusedCache) forgetAfter(cutoff int64) {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if e.reset > cutoff {
				delete(sh.m, k)
			}
		}
		sh.mu.Unlock()
	}
}

// forgetFunc drops every key for which match returns true.
func (c *refusedCache) forgetFunc(match func(string) bool) {
	for i := range c.shards {
		sh := &c.shards[i]
		sh.mu.Lock()
		for k := range sh.m {
			if match(k) {
				delete(sh.m, k)
			}
		}
		sh.mu.Unlock()
	}
}

// Interface guards
var _ Store = (*RedisStore)(nil)
