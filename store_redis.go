package ratelimit

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// hitScript is one fixed-window decision: see store_redis.lua. Run sends it
// by EVALSHA and loads it on NOSCRIPT, so a restarted Redis costs one extra
// round trip.
//
//go:embed store_redis.lua
var hitSource string

var hitScript = redis.NewScript(hitSource)

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
}

// RedisStore is a Store whose counters live in Redis, so that every Caddy
// instance sharing the Redis shares the limit. Each decision is one atomic
// Lua call; a key known to be over its limit is refused in-process until its
// window resets, so a flood costs Redis nothing per request (Run adds the
// refusals so answered to the key's refused tally once a second).
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
	prefix  string
	hashKey []byte
	timeout atomic.Int64 // time.Duration
	onError atomic.Pointer[string]
	local   *MemoryStore // the on_error local fallback
	refused refusedCache
	logger  *zap.Logger

	state      atomic.Int32
	streak     atomic.Int32 // consecutive failures when healthy, successes when recovering
	wake       chan struct{}
	probeEvery time.Duration
}

// NewRedisStore returns a RedisStore. It does not connect: the first decision
// does.
func NewRedisStore(opts RedisStoreOptions) *RedisStore {
	if opts.MaxTracked <= 0 {
		opts.MaxTracked = DefaultMaxTracked
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	s := &RedisStore{
		client:     opts.Client,
		prefix:     opts.Prefix,
		hashKey:    opts.HashKey,
		local:      NewMemoryStore(opts.MaxTracked),
		logger:     opts.Logger,
		wake:       make(chan struct{}, 1),
		probeEvery: defaultProbeEvery,
	}
	s.refused.init(opts.MaxTracked)
	s.SetTimeout(opts.Timeout)
	s.SetOnError(opts.OnError)
	return s
}

// SetTimeout changes the bound on each decision's round trip; a non-positive
// one restores the default of 100ms.
func (s *RedisStore) SetTimeout(d time.Duration) {
	if d <= 0 {
		d = DefaultRedisTimeout
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
	t := now.UnixNano()
	if reset, ok := s.refused.get(key, t, limit); ok {
		return Verdict{
			Limit:      limit.Max,
			Reset:      time.Unix(0, reset),
			RetryAfter: time.Duration(reset - t),
		}, nil
	}
	if s.state.Load() == stateDegraded {
		return s.fallback(ctx, key, now, limit, ErrRedisDegraded)
	}
	v, err := s.hitRedis(ctx, key, now, limit)
	if err != nil {
		if ctx.Err() != nil {
			// The request itself was cancelled: no verdict, and no
			// evidence against Redis.
			return Verdict{}, fmt.Errorf("redis store: %w", ctx.Err())
		}
		s.failed(err)
		return s.fallback(ctx, key, now, limit, err)
	}
	s.succeeded()
	if !v.Allowed {
		s.refused.put(key, v.Reset.UnixNano(), limit.Max, t)
	}
	return v, nil
}

// hitRedis runs the decision script for key.
func (s *RedisStore) hitRedis(ctx context.Context, key string, now time.Time, limit Limit) (Verdict, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Duration(s.timeout.Load()))
	defer cancel()
	base := s.base(s.tag(key))
	keys := []string{base + "c", base + "r"}
	cutoff := limit.cutoffIn(now).Milliseconds()
	res, err := hitScript.Run(ctx, s.client, keys, limit.Max, limit.Window.Milliseconds(), cutoff).Int64Slice()
	if err != nil {
		return Verdict{}, err
	}
	if len(res) != 4 {
		return Verdict{}, fmt.Errorf("redis store: decision script returned %d values, want 4", len(res))
	}
	v := Verdict{
		Allowed:   res[0] == 1,
		Limit:     limit.Max,
		Remaining: int(max(int64(limit.Max)-res[1], 0)),
		Reset:     now.Add(time.Duration(res[2]) * time.Millisecond),
	}
	if !v.Allowed {
		v.RetryAfter = time.Duration(res[2]) * time.Millisecond
		v.FirstRefusal = res[3] == 1
	}
	return v, nil
}

// fallback decides without Redis, as on_error says.
func (s *RedisStore) fallback(ctx context.Context, key string, now time.Time, limit Limit, cause error) (Verdict, error) {
	switch *s.onError.Load() {
	case OnErrorAllow:
		return Verdict{
			Allowed:    true,
			Limit:      limit.Max,
			Remaining:  limit.Max,
			Reset:      now.Add(limit.Window),
			StoreError: true,
		}, nil
	case OnErrorDeny:
		return Verdict{}, fmt.Errorf("redis store: %w", cause)
	default:
		v, err := s.local.Hit(ctx, key, now, limit)
		v.StoreError = true
		return v, err
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
// second while it is not degraded, and sweeps the local fallback store every
// interval(); it returns when ctx is done.
func (s *RedisStore) Run(ctx context.Context, interval func() time.Duration) {
	go s.local.RunSweeper(ctx, interval)
	tick := time.NewTicker(refusedFlushEvery)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
			s.probe(ctx)
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
			k := s.base(s.tag(p.key)) + "r"
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

// probeOnce runs the decision script on the probe key, with a limit no probe
// reaches and a one-second window. A PING would answer while decisions still
// fail (out of memory, a read-only replica, a script error), and the store
// would cycle between degraded and recovering.
func (s *RedisStore) probeOnce(ctx context.Context) error {
	base := s.base(probeTag)
	return hitScript.Run(ctx, s.client, []string{base + "c", base + "r"}, 1<<30, 1000, 1000).Err()
}

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

// base returns the Redis key of a client tag without its last letter
// ("c" for the count, "r" for the refused tally). The tag is a Cluster hash
// tag, so both keys of a client map to one slot.
func (s *RedisStore) base(tag string) string {
	return s.prefix + "{" + tag + "}:"
}

// Len implements Store. Counters in Redis are counted only by Range, which
// costs a full scan; Len returns the keys tracked in this process by the
// local fallback store.
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
	return s.scanPages(ctx, c, func(ctx context.Context, keys []string) error {
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

// CutWindows ends every window of the zone that would end after cutoff at
// cutoff, in Redis and in the local caches: a reload shortened the window.
// It scans the zone's keys a page at a time and sets each page's expiries
// in one pipeline with PEXPIRE … LT (Redis 7), which never lengthens one.
func (s *RedisStore) CutWindows(ctx context.Context, cutoff time.Time) error {
	s.refused.forgetAfter(cutoff.UnixNano())
	s.local.CutWindows(cutoff)
	return s.forEachNode(ctx, func(ctx context.Context, c scanner) error {
		return s.scanPages(ctx, c, func(ctx context.Context, keys []string) error {
			ms := time.Until(cutoff).Milliseconds()
			pipe := c.Pipeline()
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

// scanPages calls page with each page of the zone's count keys on one Redis
// node.
func (s *RedisStore) scanPages(ctx context.Context, c scanner, page func(ctx context.Context, keys []string) error) error {
	pattern := escapeGlob(s.prefix) + "{*}:c"
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

// readPage reads the count, expiry and refused tally of a page of count
// keys in one pipeline and passes the live ones to fn.
func (s *RedisStore) readPage(ctx context.Context, c scanner, keys []string, now time.Time, fn func(KeyState) bool) error {
	type row struct {
		count, refused *redis.StringCmd
		ttl            *redis.DurationCmd
	}
	rows := make([]row, len(keys))
	pipe := c.Pipeline()
	for i, k := range keys {
		rows[i] = row{
			count:   pipe.Get(ctx, k),
			ttl:     pipe.PTTL(ctx, k),
			refused: pipe.Get(ctx, strings.TrimSuffix(k, "c")+"r"),
		}
	}
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		return fmt.Errorf("reading redis counters: %w", err)
	}
	for i, k := range keys {
		count, err := rows[i].count.Int()
		ttl := rows[i].ttl.Val()
		if err != nil || ttl <= 0 {
			continue // expired between SCAN and GET
		}
		refused, _ := rows[i].refused.Int()
		tag := strings.TrimSuffix(strings.TrimPrefix(k, s.prefix+"{"), "}:c")
		if tag == probeTag {
			continue
		}
		if !fn(KeyState{Key: tag, Count: count, Refused: refused, Reset: now.Add(ttl)}) {
			return errStopRange
		}
	}
	return nil
}

// Forget implements Store. key is a client key or, with hashed keys, the
// hash Range lists. Other Caddy instances may still refuse the key from
// their local cache until its window would have reset.
func (s *RedisStore) Forget(ctx context.Context, key string) (bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	tags := []string{s.tag(key)}
	if s.hashKey != nil && isHexHash(key) {
		tags = append(tags, key)
		s.refused.forgetFunc(func(k string) bool { return s.tag(k) == key })
	}
	s.refused.forget(key)
	_, _ = s.local.Forget(ctx, key)
	found := false
	for _, tag := range tags {
		base := s.base(tag)
		// One DEL per tag: both keys share the tag's slot.
		n, err := s.client.Del(ctx, base+"c", base+"r").Result()
		if err != nil {
			return found, fmt.Errorf("deleting redis key %q: %w", base+"c", err)
		}
		found = found || n > 0
	}
	return found, nil
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
func (c *refusedCache) get(key string, t int64, limit Limit) (int64, bool) {
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.m[key]
	if !ok {
		return 0, false
	}
	// An entry that a shorter window cuts short (a reload shortened it)
	// goes: Redis, which cuts its window too, decides instead.
	if t >= e.reset || limit.end(e.reset, t) != e.reset {
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
