package limiter

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// rangeKeys calls fn for each live count key of the zone, walking them
// with SCAN (on every master of a Cluster), a page at a time, never KEYS,
// and reading each page's counts and expiries in one pipeline. With hashed
// keys, KeyState.Key is the hash (see HashedKeys). synced says the keys are
// sync mode's (redis_sync.lua): a window's counts are a hash of the
// instances' (…:g, and …:o for the window before), which outlives its
// window by a window.
func (s *redisCore) rangeKeys(ctx context.Context, now time.Time, synced bool, fn func(KeyState) bool) error {
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
	err := s.forEachNode(ctx, func(ctx context.Context, c scanner) error {
		suffix := "[cb]"
		if synced {
			suffix = "[bg]"
		}
		return s.scanPages(ctx, c, suffix, func(ctx context.Context, keys []string) error {
			return s.readPage(ctx, c, keys, now, synced, call)
		})
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

// forEachNode calls fn with the client, or with each master of a Cluster
// (concurrently).
func (s *redisCore) forEachNode(ctx context.Context, fn func(ctx context.Context, c scanner) error) error {
	if cc, ok := s.client.(*redis.ClusterClient); ok {
		return cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return fn(ctx, c) })
	}
	return fn(ctx, s.client)
}

// scanPages calls page with each page of the zone's keys of the kinds
// suffix matches (a glob: "c" for count keys, "[cb]" with ban keys, "[bg]"
// for sync mode's hashes of counts and ban keys) on one Redis node.
func (s *redisCore) scanPages(ctx context.Context, c scanner, suffix string, page func(ctx context.Context, keys []string) error) error {
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
// its window); before, the count key's row carries it. synced: as in
// rangeKeys.
func (s *redisCore) readPage(ctx context.Context, c scanner, keys []string, now time.Time, synced bool, fn func(KeyState) bool) error {
	type row struct {
		count, refused, prev *redis.StringCmd
		fleet, fleetPrev     *redis.MapStringStringCmd // synced
		ttl, ban             *redis.DurationCmd
		counted              *redis.IntCmd
	}
	counts, prevs := "c", "p"
	if synced {
		counts, prevs = "g", "o"
	}
	rows := make([]row, len(keys))
	pipe := c.Pipeline()
	for i, k := range keys {
		base := k[:len(k)-1]
		if strings.HasSuffix(k, "b") {
			rows[i] = row{ban: pipe.PTTL(ctx, k), counted: pipe.Exists(ctx, base+counts), refused: pipe.Get(ctx, base+"r")}
			continue
		}
		rows[i] = row{ttl: pipe.PTTL(ctx, k), refused: pipe.Get(ctx, base+"r"), ban: pipe.PTTL(ctx, base+"b")}
		if synced {
			rows[i].fleet, rows[i].fleetPrev = pipe.HGetAll(ctx, k), pipe.HGetAll(ctx, base+prevs)
		} else {
			rows[i].count, rows[i].prev = pipe.Get(ctx, k), pipe.Get(ctx, base+prevs)
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
		if rows[i].ttl == nil {
			if ban <= 0 || rows[i].counted.Val() > 0 {
				continue
			}
			until := now.Add(ban)
			if !fn(KeyState{Key: tag, Refused: refused, Reset: until, BannedUntil: until, Name: name}) {
				return errStopRange
			}
			continue
		}
		var count, prev int
		var err error
		if synced {
			count, err = fleetCount(rows[i].fleet.Val(), rows[i].fleet.Err())
			prev, _ = fleetCount(rows[i].fleetPrev.Val(), rows[i].fleetPrev.Err())
		} else {
			count, err = rows[i].count.Int()
			prev, _ = rows[i].prev.Int()
		}
		ttl := rows[i].ttl.Val()
		if err != nil || ttl <= 0 {
			continue // expired between SCAN and GET
		}
		ks := KeyState{Key: tag, Count: count, Refused: refused, Prev: prev, Name: name}
		if l, ok := s.limitNamed(name); ok {
			switch {
			case l.GCRA():
				// The count key holds the theoretical arrival time; it
				// expires when the bucket is full again.
				ks.Count = 0
			case l.Sliding() || synced:
				// A sliding count, and every count in sync mode, outlives
				// its window by a window, as the next one's previous count
				// (redis.lua, redis_sync.lua): its window ends a window
				// before the key does. A ban outlives it too.
				if !l.Sliding() {
					ks.Prev = 0
				}
				outlives := l.Window
				if l.Calendar != nil {
					// A calendar window's key outlives it by the next one.
					outlives = time.Duration(l.next(l.Calendar.End(now.UnixNano())))
				}
				if ttl -= outlives; ttl <= 0 {
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

// forgetEach forgets key in each of limits through forget (a store's
// ForgetCheck), and reports whether any held it.
func forgetEach(ctx context.Context, key string, limits []Check, forget func(context.Context, Check) (bool, error)) (bool, error) {
	found := false
	for _, c := range limits {
		ok, err := forget(ctx, Check{Slot: c.Slot, Name: c.Name, Key: key})
		if err != nil {
			return found, err
		}
		found = found || ok
	}
	return found, nil
}

// tagsOf returns the tags a key given to ForgetCheck may name in Redis: the
// key's own, and the key itself when it is a hash Range listed (hashed
// keys).
func (s *redisCore) tagsOf(key string) []string {
	tags := []string{s.tag(key)}
	if s.hashKey != nil && isHexHash(key) {
		tags = append(tags, key)
	}
	return tags
}

// forgetCheck is ForgetCheck of a Redis store: forgetLocal drops c's key,
// whose tags (its own, and the key itself when it is a listed hash) it is
// given, from the store's in-process state; then Redis forgets it, and the
// other instances hear of it.
func (s *redisCore) forgetCheck(ctx context.Context, c Check, forgetLocal func(tags []string)) (bool, error) {
	s.markUsed()
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	tags := s.tagsOf(c.Key)
	forgetLocal(tags)
	return s.deleteKeys(ctx, c.Name, tags)
}

// deleteKeys deletes the named limit's keys of each tag in Redis (counts,
// refused tally, ban, strikes; one DEL per tag, whose keys share its slot)
// and announces each one found on the unblock channel, so that every
// instance drops it from its in-process state (listen). It reports whether
// any was found.
func (s *redisCore) deleteKeys(ctx context.Context, name string, tags []string) (bool, error) {
	found := false
	for _, tag := range tags {
		base := s.base(name, tag)
		n, err := s.client.Del(ctx, base+"c", base+"r", base+"p", base+"b", base+"s", base+"g", base+"o").Result()
		if err != nil {
			return found, fmt.Errorf("deleting redis key %q: %w", base+"c", err)
		}
		found = found || n > 0
		if n > 0 {
			if err := s.client.Publish(ctx, s.unblockChannel(), name+"\x00"+tag).Err(); err != nil {
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
