package limiter

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// RedisStore is the exact Redis store: a Store whose counters live in
// Redis, so that every Caddy instance sharing the Redis shares the limit.
// Each decision is one atomic Lua call; a key known to be over its limit is
// refused in-process until its window resets, so a flood costs Redis
// nothing per request (Run adds the refusals so answered to the key's
// refused tally once a second).
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
	redisCore
	pipe *redis.AutoPipeliner // batches concurrent decisions; nil: one call each
	// deadline is the context the decisions starting now share.
	deadline atomic.Pointer[decisionDeadline]
	boxed    atomic.Pointer[boxedLimit] // the last fixed limit's script arguments
	local    *MemoryStore               // the on_error local fallback
	refused  refusedCache
	// chargeFailing is set from a failed charge until one lands, so that
	// an outage logs its first failed charge, not every one.
	chargeFailing atomic.Bool
}

// NewRedisStore returns an exact RedisStore (opts.Sync is not read: see
// NewSyncStore). It does not connect: the first decision does, and starts
// the client's warm-up (Warmup).
func NewRedisStore(opts RedisStoreOptions) *RedisStore {
	s := &RedisStore{}
	s.init(&opts, s)
	s.local = NewMemoryStore(opts.MaxTracked)
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
	return s
}

// SetMaxTracked changes the bound on the store's in-process state.
func (s *RedisStore) SetMaxTracked(n int) {
	s.local.SetMaxTracked(n)
	s.refused.setCap(n)
}

// Configure implements Store: the decisions' timeout and on_error mode,
// the bound on the in-process state and the zone's limits. The local
// fallback store is configured alike.
func (s *RedisStore) Configure(st Settings) {
	s.configure(st)
	s.SetMaxTracked(st.MaxTracked)
	s.local.Configure(st)
}

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
	t := now.UnixNano()
	var resets [MaxChecks]int64
	var pending [MaxChecks]bool
	cached := false
	for i := range checks {
		c := &checks[i]
		if c.Free || c.force {
			continue // at max it is admitted: Redis knows; the cache does not
		}
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
	capped := s.takeLeases(checks)
	err := s.decideRedis(ctx, checks, now, out)
	if err != nil {
		if ctx.Err() != nil {
			// The request itself was cancelled: no verdict, and no
			// evidence against Redis.
			if capped {
				s.keepLeases(checks, nil, false)
			}
			return fmt.Errorf("redis store: %w", ctx.Err())
		}
		s.failed(err)
		err = s.fallback(ctx, checks, now, out, err)
		if capped {
			s.keepLeases(checks, out, false) // the local store holds the slots
		}
		return err
	}
	s.succeeded()
	if capped {
		s.keepLeases(checks, out, true)
	}
	for i := range checks {
		c := &checks[i]
		if !out[i].Allowed && c.cost() == 1 && !out[i].InFlightFull {
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

// Charge implements Store: off the caller's path, in a goroutine of its
// own bounded by the store's timeout for slow calls. The first failure
// after a charge that landed is logged.
func (s *RedisStore) Charge(_ context.Context, checks []Check, now time.Time, verdicts []Verdict) error {
	checks, verdicts = slices.Clone(checks), slices.Clone(verdicts)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), s.slowTimeout())
		defer cancel()
		err := charge(ctx, s, checks, now, verdicts)
		if err == nil {
			s.chargeFailing.Store(false)
		} else if !s.chargeFailing.Swap(true) {
			s.logger.Warn("charging what a response reported failed; further failures are not logged until a charge lands", zap.Error(err))
		}
	}()
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
	s.refused.put(cacheKey(c.Name, c.Key), until.UnixNano(), c.Limit.Max, false, now.UnixNano())
	return until, nil
}

// Run probes Redis whenever the store is degraded, until it is healthy
// again, adds the refusals answered in-process to the tallies in Redis every
// second while it is not degraded, runs the counts CountKeys asks for, and
// sweeps the local fallback store every interval(); it returns when ctx is
// done.
func (s *RedisStore) Run(ctx context.Context, interval func() time.Duration) {
	go s.local.Run(ctx, interval)
	go s.renewLeases(ctx)
	s.run(ctx, func(ctx context.Context) {
		fctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
		defer cancel()
		if err := s.flushRefused(fctx, s.clock.Now()); err != nil {
			s.logger.Debug("adding cached refusals to redis", zap.Error(err))
		}
	})
}

// probeOnce runs both decision scripts on the probe key, with a limit no
// probe reaches and a one-second window. A PING would answer while decisions still
// fail (out of memory, a read-only replica, a script error), and the store
// would cycle between degraded and recovering.
func (s *RedisStore) probeOnce(ctx context.Context) error {
	base := s.base("", probeTag)
	// The decisions' own path (the auto-pipeliner, when on): a probe
	// through another connection would call a Redis healthy that the
	// decisions still cannot reach.
	_, err := s.runScript(ctx, hitScript, []string{base + "c", base + "r", base + "p"}, []any{1 << 30, 1000, 1000, 0, 1, 0, "", ""})
	if err == nil {
		_, err = s.runScript(ctx, fixedScript, []string{base + "c", base + "r"}, []any{1 << 30, 1000, 1000, 1})
	}
	return err
}

// recovered implements redisOwner: the decisions go to Redis again.
func (s *RedisStore) recovered() {}

// Len implements Store: the keys tracked in this process by the local
// fallback store (Redis's are counted by CountKeys).
func (s *RedisStore) Len() int { return s.local.Len() }

// Range implements Store (rangeKeys), once the refusals answered in-process
// are added to Redis's tallies.
func (s *RedisStore) Range(ctx context.Context, now time.Time, fn func(KeyState) bool) error {
	fctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	err := s.flushRefused(fctx, now)
	cancel()
	if err != nil {
		return fmt.Errorf("adding cached refusals to redis: %w", err)
	}
	return s.rangeKeys(ctx, now, false, fn)
}

// CutWindows ends every window of the limit c names (its Slot and Name)
// that would end after cutoff at cutoff, in Redis and in the local caches: a
// reload shortened the limit's window. It scans the zone's keys a page at a
// time and sets each page's expiries in one pipeline with PEXPIRE … LT
// (Redis 7), which never lengthens one.
func (s *RedisStore) CutWindows(ctx context.Context, c Check, cutoff time.Time) error {
	s.refused.forgetAfter(cutoff.UnixNano())
	s.local.cutSlot(c.Slot, cutoff)
	return s.forEachNode(ctx, func(ctx context.Context, node scanner) error {
		return s.scanPages(ctx, node, "*{*}:c", func(ctx context.Context, keys []string) error {
			keys = slices.DeleteFunc(keys, func(k string) bool {
				name, _, ok := s.parseKey(k)
				return !ok || name != c.Name
			})
			ms := cutoff.Sub(s.clock.Now()).Milliseconds()
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

// Forget implements Store: it forgets key in every limit of the zone. key is
// a client key or, with hashed keys, the hash Range lists. The other Caddy
// instances sharing the Redis hear of it on the unblock channel (listen).
func (s *RedisStore) Forget(ctx context.Context, key string) (bool, error) {
	return forgetEach(ctx, key, s.zoneLimits(), s.ForgetCheck)
}

// ForgetCheck implements Store.
func (s *RedisStore) ForgetCheck(ctx context.Context, c Check) (bool, error) {
	return s.forgetCheck(ctx, c, func(tags []string) {
		if len(tags) > 1 {
			s.refused.forgetFunc(func(k string) bool {
				name, key := splitCacheKey(k)
				return name == c.Name && s.tag(key) == c.Key
			})
		}
		s.refused.forget(cacheKey(c.Name, c.Key))
		_, _ = s.local.ForgetCheck(ctx, c)
	})
}

// subscribed implements redisOwner: what was cached before this
// (re)subscription may have been unblocked unheard, so the refused cache is
// emptied, its pending refusal tallies sent to Redis first: the next
// decision of each key goes to Redis, which is never stale.
func (s *RedisStore) subscribed(ctx context.Context) {
	fctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	_ = s.flushRefused(fctx, s.clock.Now())
	cancel()
	s.refused.forgetFunc(func(string) bool { return true })
}

// dropCached implements redisOwner: the key whose tag (the key, or its
// hash) is tag goes from the named limit's refused cache and from the local
// fallback store.
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

// Interface guards
var _ Overrider = (*RedisStore)(nil)
