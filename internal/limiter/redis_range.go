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
// keys, KeyState.Key is the hash (see HashedKeys). synced says the counts
// are sync mode's (redis_sync.lua): a hash per window, a field per key
// (rangeWindows).
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
		if synced {
			return s.rangeWindows(ctx, c, now, call)
		}
		return s.scanPages(ctx, c, "*{*}:[cb]", func(ctx context.Context, keys []string) error {
			return s.readPage(ctx, c, keys, now, call)
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
	HScan(ctx context.Context, key string, cursor uint64, match string, count int64) *redis.ScanCmd
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

// scanPages calls page with each page of the zone's keys that match (a
// glob after the prefix: "*{*}:c" for count keys, "*{*}:[cb]" with ban
// keys, "w:{*}:*" for sync mode's window hashes) on one Redis node.
func (s *redisCore) scanPages(ctx context.Context, c scanner, match string, page func(ctx context.Context, keys []string) error) error {
	pattern := escapeGlob(s.prefix) + match
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
func (s *redisCore) readPage(ctx context.Context, c scanner, keys []string, now time.Time, fn func(KeyState) bool) error {
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
		rows[i] = row{ttl: pipe.PTTL(ctx, k), refused: pipe.Get(ctx, base+"r"), ban: pipe.PTTL(ctx, base+"b"),
			count: pipe.Get(ctx, k), prev: pipe.Get(ctx, base+"p")}
	}
	if err := execReads(ctx, pipe); err != nil {
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
		count, err := rows[i].count.Int()
		prev, _ := rows[i].prev.Int()
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
			case l.Sliding():
				// A sliding count outlives its window by a window, as the
				// next one's previous count (redis.lua): its window ends a
				// window before the key does. A ban outlives it too.
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

// rangeWindows lists sync mode's keys on one Redis node: the fields of the
// window hashes of running windows (redis_sync.lua), each with its refused
// tally, ban and, for a sliding window, the previous window's count, a page
// of fields to a pipeline; then the banned keys without a count in the
// running window.
func (s *redisCore) rangeWindows(ctx context.Context, c scanner, now time.Time, fn func(KeyState) bool) error {
	ms := now.UnixMilli()
	err := s.scanPages(ctx, c, "w:{*}:*", func(ctx context.Context, hashes []string) error {
		for _, h := range hashes {
			wtag, end, length, ok := s.parseWindowKey(h)
			if !ok || end <= ms {
				continue // the previous window's, whose keys count in the running one
			}
			if err := s.hscanPages(ctx, c, h, func(ctx context.Context, fields []string) error {
				return s.readWindowPage(ctx, c, wtag, end, length, fields, now, fn)
			}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	return s.scanPages(ctx, c, "*{*}:b", func(ctx context.Context, keys []string) error {
		return s.readBans(ctx, c, keys, now, fn)
	})
}

// hscanPages calls page with each page of hash h's fields and values
// (alternating), walked with HSCAN.
func (s *redisCore) hscanPages(ctx context.Context, c scanner, h string, page func(ctx context.Context, fields []string) error) error {
	var cursor uint64
	for {
		sctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
		fields, next, err := c.HScan(sctx, h, cursor, "", scanPage).Result()
		if err == nil && len(fields) > 0 {
			err = page(sctx, fields)
		} else if err != nil && !redis.HasErrorPrefix(err, "WRONGTYPE") {
			err = fmt.Errorf("scanning redis hash %q: %w", h, err)
		} else {
			err = nil // not a hash: not the module's
		}
		cancel()
		if err != nil || next == 0 {
			return err
		}
		cursor = next
	}
}

// readWindowPage lists a page of the fields (and values, alternating) of
// the hash of windows that end at end and last length (Unix ms) under hash
// tag wtag: each key of a limit with such windows, with its refused tally,
// ban and, sliding, the previous window's count, read in one pipeline.
func (s *redisCore) readWindowPage(ctx context.Context, c scanner, wtag string, end, length int64, fields []string, now time.Time, fn func(KeyState) bool) error {
	type row struct {
		ks           KeyState
		refused, prv *redis.StringCmd
		ban          *redis.DurationCmd
	}
	rows := make([]row, 0, len(fields)/2)
	pipe := c.Pipeline()
	for i := 0; i+1 < len(fields); i += 2 {
		name, tag, ok := s.parseKey(fields[i])
		if !ok || tag == probeTag {
			continue
		}
		l, _ := s.limitNamed(name)
		configured := l.Window > 0 || l.Calendar != nil
		if configured && l.length(end*int64(time.Millisecond))/int64(time.Millisecond) != length {
			continue // another limit's windows, or a reload's before
		}
		count, err := fleetCount(fields[i+1])
		if err != nil {
			continue // not the module's
		}
		base := fields[i][:len(fields[i])-1]
		r := row{ks: KeyState{Key: tag, Count: count, Name: name, Reset: time.UnixMilli(end)},
			refused: pipe.Get(ctx, base+"r"), ban: pipe.PTTL(ctx, base+"b")}
		if configured && l.Sliding() {
			start := end - length
			prevLength := l.length(start*int64(time.Millisecond)) / int64(time.Millisecond)
			r.prv = pipe.HGet(ctx, s.windowKey(wtag, start, prevLength), fields[i])
		}
		rows = append(rows, r)
	}
	if len(rows) == 0 {
		return nil
	}
	if err := execReads(ctx, pipe); err != nil {
		return fmt.Errorf("reading redis counters: %w", err)
	}
	for _, r := range rows {
		r.ks.Refused, _ = r.refused.Int()
		if ban := r.ban.Val(); ban > 0 {
			r.ks.BannedUntil = now.Add(ban)
		}
		if r.prv != nil {
			r.ks.Prev, _ = fleetCount(r.prv.Val())
		}
		if !fn(r.ks) {
			return errStopRange
		}
	}
	return nil
}

// readBans lists the keys of a page of ban keys (…:b) that have no count
// in their limit's running window (those rangeWindows lists with theirs).
func (s *redisCore) readBans(ctx context.Context, c scanner, keys []string, now time.Time, fn func(KeyState) bool) error {
	type row struct {
		name, tag string
		ban       *redis.DurationCmd
		counted   *redis.BoolCmd
		refused   *redis.StringCmd
	}
	rows := make([]row, 0, len(keys))
	pipe := c.Pipeline()
	ms := now.UnixMilli()
	for _, k := range keys {
		name, tag, ok := s.parseKey(k)
		if !ok || tag == probeTag {
			continue
		}
		base := k[:len(k)-1]
		r := row{name: name, tag: tag, ban: pipe.PTTL(ctx, k), refused: pipe.Get(ctx, base+"r")}
		if l, _ := s.limitNamed(name); l.Window > 0 || l.Calendar != nil {
			end, length := syncWindowAt(l, ms)
			r.counted = pipe.HExists(ctx, s.windowKey(s.windowTag(base+"g"), end, length), base+"g")
		}
		rows = append(rows, r)
	}
	if len(rows) == 0 {
		return nil
	}
	if err := execReads(ctx, pipe); err != nil {
		return fmt.Errorf("reading redis bans: %w", err)
	}
	for _, r := range rows {
		ban := r.ban.Val()
		if ban <= 0 || r.counted != nil && r.counted.Val() {
			continue
		}
		refused, _ := r.refused.Int()
		until := now.Add(ban)
		if !fn(KeyState{Key: r.tag, Refused: refused, Reset: until, BannedUntil: until, Name: r.name}) {
			return errStopRange
		}
	}
	return nil
}

// syncWindowAt returns the end and length (Unix ms) of limit l's window in
// sync mode that holds ms: windows aligned to the epoch, or the calendar's
// (syncTable.entry).
func syncWindowAt(l Limit, ms int64) (end, length int64) {
	if l.Calendar != nil {
		end = l.Calendar.End(ms*int64(time.Millisecond)) / int64(time.Millisecond)
		return end, l.length(end*int64(time.Millisecond)) / int64(time.Millisecond)
	}
	w := max(l.Window.Milliseconds(), 1)
	return (ms/w + 1) * w, w
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
// refused tally, ban, strikes; one DEL per tag, whose keys share its slot;
// in sync mode its fields of the running and previous windows' hashes)
// and announces each one found on the unblock channel, so that every
// instance drops it from its in-process state (listen). It reports whether
// any was found.
func (s *redisCore) deleteKeys(ctx context.Context, name string, tags []string) (bool, error) {
	found := false
	l, _ := s.limitNamed(name)
	known := l.Window > 0 || l.Calendar != nil
	for _, tag := range tags {
		base := s.base(name, tag)
		pipe := s.client.Pipeline()
		cmds := []*redis.IntCmd{pipe.Del(ctx, base+"c", base+"r", base+"p", base+"b", base+"s")}
		if known {
			field, wtag := base+"g", s.windowTag(base+"g")
			end, length := syncWindowAt(l, s.clock.Now().UnixMilli())
			prevLength := l.length((end-length)*int64(time.Millisecond)) / int64(time.Millisecond)
			cmds = append(cmds, pipe.HDel(ctx, s.windowKey(wtag, end, length), field),
				pipe.HDel(ctx, s.windowKey(wtag, end-length, prevLength), field))
		}
		if _, err := pipe.Exec(ctx); err != nil {
			return found, fmt.Errorf("deleting redis key %q: %w", base+"c", err)
		}
		n := int64(0)
		for _, c := range cmds {
			n += c.Val()
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

// execReads sends a listing's pipeline of reads. Exec returns the first
// command's error: one for a missing key, or a damaged one (WRONGTYPE, see
// redis.lua), is that row's alone, and not the listing's.
func execReads(ctx context.Context, pipe redis.Pipeliner) error {
	if _, err := pipe.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) && !redis.HasErrorPrefix(err, "WRONGTYPE") {
		return err
	}
	return nil
}
