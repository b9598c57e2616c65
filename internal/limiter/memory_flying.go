package limiter

import "context"

// Requests in flight (Check.MaxInFlight) on the memory store: each shard
// counts the slots its keys hold per limit, and a key with none is not
// kept, so the map holds only the keys whose requests are being served.

// takeSlot counts one more request of key in flight in slot. The caller
// holds the shard's lock.
func (sh *memShard) takeSlot(slot int, key string) {
	m := sh.flying[slot]
	if m == nil {
		m = make(map[string]int32)
		sh.flying[slot] = m
	}
	// The key is kept as the request gave it: a key leaves the map when
	// its last request ends, and what a key string pins (a client IP, a
	// key the handler built) is a few bytes.
	m[key]++
}

// Release implements Store. It never returns an error.
func (s *MemoryStore) Release(_ context.Context, checks []Check) error {
	for i := range checks {
		c := &checks[i]
		if c.MaxInFlight <= 0 || c.Slot < 0 || c.Slot >= MaxChecks {
			continue
		}
		sh := &s.shards[s.hash(c.Key, c.Slot)&s.mask]
		sh.mu.Lock()
		if m := sh.flying[c.Slot]; m != nil {
			if n := m[c.Key]; n > 1 {
				m[c.Key] = n - 1
			} else {
				delete(m, c.Key)
			}
		}
		sh.mu.Unlock()
	}
	return nil
}
