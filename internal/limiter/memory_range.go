package limiter

import (
	"context"
	"time"
	"unsafe"
)

// RangeLen implements Store: the windows tracked plus the bans, since
// Range lists a ban on its own once its window has ended.
func (s *MemoryStore) RangeLen() (int, bool) { return int(s.tracked.Load() + s.banned.Load()), true }

// Range implements Store. It copies one shard at a time under that shard's
// lock and calls fn with no lock held. A sliding window is listed until it
// ends, like a fixed one.
func (s *MemoryStore) Range(ctx context.Context, now time.Time, fn func(KeyState) bool) error {
	t := now.UnixNano()
	var names [MaxChecks]string
	s.namesMu.Lock()
	names = s.names
	s.namesMu.Unlock()
	var batch []KeyState
	listed := func(sh *memShard, slot int, k string, e memEntry) {
		if t < e.reset {
			ks := KeyState{Key: k, Count: int(e.count), Refused: int(e.refused), Reset: time.Unix(0, e.reset), Prev: int(e.prev), Name: names[slot],
				InFlight: int(sh.flying[slot][k])}
			if b, ok := sh.bans[slot][k]; ok && b.until > t {
				ks.BannedUntil = time.Unix(0, b.until)
			}
			batch = append(batch, ks)
		}
	}
	for i := range s.shards {
		if err := ctx.Err(); err != nil {
			return err
		}
		sh := &s.shards[i]
		batch = batch[:0]
		sh.mu.Lock()
		for slot, m := range sh.entries {
			for k, e := range m {
				listed(sh, slot, k, e)
			}
		}
		// The shard's short keys as strings cut from one buffer: one
		// allocation per shard rather than one per key (a listing reads
		// every key to page and filter, and keeps few).
		text := make([]byte, 0, sh.short.live*inlineMax)
		for j := range sh.short.slots {
			if sl := &sh.short.slots[j]; sl.key.live() && t < sl.reset {
				at := len(text)
				text = append(text, sl.key.bytes()...)
				listed(sh, sl.key.slot(), unsafe.String(unsafe.SliceData(text[at:]), len(text)-at), sl.entry())
			}
		}
		for slot, m := range sh.bans {
			for k, b := range m {
				// A ban outlives its window: listed on its own once the
				// window has ended.
				if e, _, ok := sh.find(s.hash(k, slot), slot, k); b.until > t && (!ok || t >= e.reset) {
					batch = append(batch, KeyState{Key: k, Reset: time.Unix(0, b.until), BannedUntil: time.Unix(0, b.until), Name: names[slot]})
				}
			}
		}
		sh.mu.Unlock()
		for _, ks := range batch {
			if !fn(ks) {
				return nil
			}
		}
	}
	return nil
}

// Forget implements Store: it drops key from every slot. It never returns
// an error.
func (s *MemoryStore) Forget(ctx context.Context, key string) (bool, error) {
	found := false
	for slot := range MaxChecks {
		ok, _ := s.ForgetCheck(ctx, Check{Slot: slot, Key: key})
		found = found || ok
	}
	return found, nil
}

// ForgetCheck implements Store. It never returns an error.
func (s *MemoryStore) ForgetCheck(_ context.Context, c Check) (bool, error) {
	if c.Slot < 0 || c.Slot >= MaxChecks {
		return false, nil
	}
	h := s.hash(c.Key, c.Slot)
	sh := &s.shards[h&s.mask]
	sh.mu.Lock()
	_, at, ok := sh.find(h, c.Slot, c.Key)
	if ok {
		sh.remove(at, c.Slot, c.Key)
		s.tracked.Add(-1)
		s.publish(int(h & s.mask))
	}
	if _, banned := sh.bans[c.Slot][c.Key]; banned {
		delete(sh.bans[c.Slot], c.Key)
		s.banned.Add(-1)
		ok = true
	}
	sh.mu.Unlock()
	return ok, nil
}

// CutWindows implements Store: the store is this process's, so it is cut
// at once. It never fails.
func (s *MemoryStore) CutWindows(_ context.Context, c Check, cutoff time.Time) error {
	s.cutSlot(c.Slot, cutoff)
	return nil
}

// cutSlot ends every window of the limit in slot that would end after
// cutoff at cutoff.
func (s *MemoryStore) cutSlot(slot int, cutoff time.Time) {
	c := cutoff.UnixNano()
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		m := sh.entries[slot]
		for k, e := range m {
			if e.reset > c {
				e.reset = c
				m[k] = e
			}
		}
		for j := range sh.short.slots {
			if sl := &sh.short.slots[j]; sl.key.live() && sl.key.slot() == slot && sl.reset > c {
				sl.reset = c
			}
		}
		sh.mu.Unlock()
	}
}

// HashedKeys implements Store: a memory store keeps keys as they are.
func (s *MemoryStore) HashedKeys() bool { return false }

// Tag implements Store: key itself.
func (s *MemoryStore) Tag(key string) string { return key }
