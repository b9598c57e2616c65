package limiter

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// RangeLen implements Store: Redis's keys are counted only by walking
// them.
func (s *RedisStore) RangeLen() (int, bool) { return 0, false }

// Evictions implements Store: Redis evicts nothing of the zone's (its
// maxmemory policy aside).
func (s *RedisStore) Evictions() uint64 { return 0 }

// Len implements Store. Counters in Redis are counted only by walking them
// (CountKeys); Len returns the keys tracked in this process by the local
// fallback store.
func (s *RedisStore) Len() int {
	if s.sync != nil {
		return int(s.sync.len.Load())
	}
	return s.local.Len()
}

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
	s.local.cutSlot(c.Slot, cutoff)
	if s.sync != nil {
		// Windows of another length are other aligned windows: the next
		// decision starts afresh, and redis_sync.lua drops a count
		// written under a longer window.
		return nil
	}
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
			case l.Sliding || s.sync != nil:
				// A sliding count, and every count in sync mode, outlives
				// its window by a window, as the next one's previous count
				// (redis.lua, redis_sync.lua): its window ends a window
				// before the key does. A ban outlives it too.
				if !l.Sliding {
					ks.Prev = 0
				}
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
	s.forgetSync(c.Name, tags)
	found := false
	for _, tag := range tags {
		base := s.base(c.Name, tag)
		// One DEL per tag: its keys share the tag's slot.
		n, err := s.client.Del(ctx, base+"c", base+"r", base+"p", base+"b", base+"s", base+"h", base+"q").Result()
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
