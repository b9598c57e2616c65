package limiter

import (
	"context"
	"errors"
	"hash/maphash"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

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
	// unbanned is true for a refusal that settled no ban: its limit did
	// not ban, or the check was NoBan (a dry run, requests in flight).
	// A check that bans does not take the entry's answer: see get.
	unbanned bool
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

// get returns the reset time of key if it is known to be over c's limit at
// t, and then counts one refusal for drain. A refusal that settled no ban
// answers a check that bans only as the script would: a NoBan check gets
// it with pending true (Verdict.PendingBan); any other goes to Redis, which
// starts the ban (and its escalation) at this refusal.
func (c *refusedCache) get(key string, t int64, check *Check) (reset int64, pending, ok bool) {
	limit := &check.Limit
	sh := c.shard(key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, found := sh.m[key]
	if !found {
		return 0, false, false
	}
	bans := e.unbanned && limit.Ban > 0
	// An entry that a shorter window cuts short (a reload shortened it)
	// goes: Redis, which cuts its window too, decides instead. So does
	// one that a check now owes a ban (a dry run went live).
	if t >= e.reset || (limit.Ban == 0 && limit.End(e.reset, t) != e.reset) || (bans && !check.NoBan) {
		delete(sh.m, key)
		return 0, false, false
	}
	if limit.Max > e.max {
		return 0, false, false
	}
	e.pending++
	sh.m[key] = e
	if !c.dirty.Load() { // a flood reads the flag, never writes it
		c.dirty.Store(true)
	}
	return e.reset, bans, true
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

// put records that key is over limitMax until reset; unbanned says the
// refusal settled no ban (refusedEntry.unbanned).
func (c *refusedCache) put(key string, reset int64, limitMax int, unbanned bool, t int64) {
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
	sh.m[strings.Clone(key)] = refusedEntry{reset: reset, max: limitMax, unbanned: unbanned}
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
