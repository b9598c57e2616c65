package limiter

import (
	"context"
	"strings"
	"time"
)

// banEntry is a key's ban in one limit (Limit.Ban), kept apart from its
// window: a ban outlives the window, and a limit without bans pays nothing.
type banEntry struct {
	until   int64 // Unix nanoseconds at which the ban ends
	keep    int64 // Unix nanoseconds until which the entry is kept: the ban's end, or the strikes' memory
	strikes int32 // violations in a row, each within BanStrikeMemory of the one before
}

// ban records a violation of c's limit by c.Key at t and returns when the
// key's ban ends, or 0 when the store holds as many bans as it tracks keys
// and none has expired (the limit still refuses, as its window says). The
// caller holds the shard's lock.
func (s *MemoryStore) ban(idx uint64, c *Check, t int64) int64 {
	sh := &s.shards[idx]
	m := sh.bans[c.Slot]
	if m == nil {
		m = make(map[string]banEntry)
		sh.bans[c.Slot] = m
	}
	b, ok := m[c.Key]
	if !ok {
		if s.banned.Load() >= s.maxTracked.Load() && sh.purgeBans(s, t, false) == 0 && s.reclaimBans(idx, t) == 0 {
			return 0
		}
		s.banned.Add(1)
	}
	if ok && b.keep > t && c.Limit.BanMax > c.Limit.Ban {
		b.strikes = min(b.strikes+1, 62)
	} else {
		b.strikes = 1
	}
	b.until = t + int64(c.Limit.banFor(int64(b.strikes)))
	b.keep = b.until
	if c.Limit.BanMax > c.Limit.Ban {
		// Violations are remembered for a day after the ban ends: the
		// next one cannot come before.
		b.keep = b.until + int64(BanStrikeMemory)
	}
	if ok {
		m[c.Key] = b
	} else {
		m[strings.Clone(c.Key)] = b
	}
	return b.until
}

// reclaimBans makes room for a ban in a full store: it drops, in every
// shard but idx (whose lock the caller holds) that it can lock without
// waiting, the bans that have ended but are kept for their violations.
// Live bans are never dropped.
func (s *MemoryStore) reclaimBans(idx uint64, t int64) int {
	n := 0
	for j := range s.shards {
		o := &s.shards[j]
		if uint64(j) == idx || !o.mu.TryLock() {
			continue
		}
		n += o.purgeBans(s, t, true)
		o.mu.Unlock()
	}
	return n + s.shards[idx].purgeBans(s, t, true)
}

// purgeBans deletes the shard's bans that have expired at t (or, with
// ended, whose ban has ended though their violations are still kept) and
// returns how many. The caller holds sh.mu.
func (sh *memShard) purgeBans(s *MemoryStore, t int64, ended bool) int {
	n := 0
	for _, m := range sh.bans {
		for k, b := range m {
			if t >= b.keep || (ended && t >= b.until) {
				delete(m, k)
				n++
			}
		}
	}
	s.banned.Add(-int64(n))
	return n
}

// Ban implements Store. It never returns an error.
func (s *MemoryStore) Ban(_ context.Context, c Check, now time.Time) (time.Time, error) {
	if c.Slot < 0 || c.Slot >= MaxChecks || c.Limit.Ban <= 0 {
		return time.Time{}, nil
	}
	h := s.hash(c.Key, c.Slot)
	idx := h & s.mask
	sh := &s.shards[idx]
	sh.mu.Lock()
	until := s.ban(idx, &c, now.UnixNano())
	sh.mu.Unlock()
	if until == 0 {
		return time.Time{}, nil
	}
	return time.Unix(0, until), nil
}
