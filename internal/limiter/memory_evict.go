package limiter

import (
	"context"
	"math"
	"strings"
	"time"
)

// orderItem records one insertion; an item whose seq no longer matches the
// entry's is stale (the key was purged, forgotten or re-inserted). The low
// bits of seq hold the entry's slot, so that the item stays 24 bytes.
type orderItem struct {
	key string
	seq uint64
}

// slotBits is how many low bits of a seq hold the slot.
const slotBits = 3

// Every slot fits in slotBits: the build fails if MaxChecks grows past it.
var _ [1<<slotBits - MaxChecks]struct{}

// slot returns the slot of the entry the item records.
func (it orderItem) slot() int { return int(it.seq & (1<<slotBits - 1)) }

// insertEvictions is the most keys one insert evicts: one makes its room at
// the bound; the second shrinks a store above a lowered bound even while
// the sweeper that trims it is not running, at a request's cost of one
// eviction more, never of the whole excess.
const insertEvictions = 2

// insert adds e as the entry of the check's key, whose hash is h, with the
// store's next insertion seq. The caller holds the shard's lock, and calls
// makeRoom once it holds no lock.
func (s *MemoryStore) insert(h uint64, c *Check, e *memEntry) {
	idx := h & s.mask
	sh := &s.shards[idx]
	seq := s.seq.Add(1)
	s.tracked.Add(1)
	if s.oldest[idx].Load() == noKeys {
		s.oldest[idx].Store(seq)
	}
	if k, short := packKey(c.Slot, c.Key); short {
		sh.short.add(uint32(h>>32), &k, e, uint32(seq))
		return
	}
	m := sh.entries[c.Slot]
	if m == nil {
		m = make(map[string]memEntry)
		sh.entries[c.Slot] = m
	}
	key := strings.Clone(c.Key) // never pin the request's memory in the map
	e.seq = seq<<slotBits | uint64(c.Slot)
	m[key] = *e
	sh.order = append(sh.order, orderItem{key: key, seq: e.seq})
}

// makeRoom evicts, for n keys just inserted, up to insertEvictions keys
// each while the store is over its bound, the oldest first. The caller
// holds no shard lock: the oldest key may be in any shard, and evictFirst
// takes its lock.
func (s *MemoryStore) makeRoom(n int) {
	for range n * insertEvictions {
		if !s.over() || !s.evictFirst() {
			return
		}
	}
}

// evictFirst evicts the store's oldest key and reports whether there was
// one. The caller holds no shard lock.
func (s *MemoryStore) evictFirst() bool {
	idx, _ := s.lockOldest()
	if idx < 0 {
		return false
	}
	sh := &s.shards[idx]
	ok := sh.evictOldest(s)
	s.publish(idx)
	sh.mu.Unlock()
	return ok
}

// noKeys is the oldest seq of a shard that holds no key.
const noKeys = math.MaxUint64

// evictTries is how many shards lockOldest locks at most to find the
// store's oldest key.
const evictTries = 4

// lockOldest locks the shard that holds the store's oldest key and returns
// its index, and the least oldest seq the other shards publish; -1 when the
// store is empty. It reads the oldest seq each shard publishes and locks
// only the shard with the least, so that it never holds two shard locks.
// When that seq has changed by the time it holds the lock (another
// goroutine evicted or removed the key meanwhile), it searches again, up to
// evictTries times; after that the shard found last is taken as it is.
func (s *MemoryStore) lockOldest() (idx int, next uint64) {
	for try := 1; ; try++ {
		var least uint64
		idx, least, next = s.oldestShard()
		if idx < 0 {
			return -1, noKeys
		}
		sh := &s.shards[idx]
		sh.mu.Lock()
		// Seqs are never reused: the same seq is the same oldest key.
		if s.oldest[idx].Load() == least || try == evictTries {
			return idx, next
		}
		sh.mu.Unlock()
	}
}

// oldestShard returns the shard that publishes the least oldest seq and
// that seq, or -1 when every shard is empty, and the least oldest seq of
// the other shards.
func (s *MemoryStore) oldestShard() (idx int, least, next uint64) {
	idx, least, next = -1, noKeys, noKeys
	for i := range s.oldest {
		switch seq := s.oldest[i].Load(); {
		case seq < least:
			idx, least, next = i, seq, least
		case seq < next:
			next = seq
		}
	}
	return idx, least, next
}

// publish records the seq of shard idx's oldest key for lockOldest. The
// caller holds the shard's lock.
func (s *MemoryStore) publish(idx int) {
	s.oldest[idx].Store(s.shards[idx].oldestSeq(s.seq.Load()))
}

// oldestSeq returns the insertion seq of the shard's oldest key, short or
// long, or noKeys. cur is the store's last seq. The caller holds sh.mu.
func (sh *memShard) oldestSeq(cur uint64) uint64 {
	seq := uint64(noKeys)
	if it, ok := sh.oldestLong(); ok {
		seq = it.seq >> slotBits
	}
	if _, low, ok := sh.short.oldest(); ok {
		seq = min(seq, widen(cur, low))
	}
	return seq
}

// widen returns the seq whose low 32 bits are low, of the 2^32 seqs up to
// cur. The inline table keeps a seq's low 32 bits: a short key's seq is
// exact until 2^32 keys were inserted after it, a long key's always (a
// short key older than that passes for a newer one, and is evicted late).
func widen(cur uint64, low uint32) uint64 {
	return cur - uint64(uint32(cur)-low)
}

// oldestLong returns the insertion record of the shard's oldest long key,
// dropping the stale records before it, or false when the shard holds
// none. The caller holds sh.mu.
func (sh *memShard) oldestLong() (orderItem, bool) {
	for sh.head < len(sh.order) {
		it := sh.order[sh.head]
		if e, ok := sh.entries[it.slot()][it.key]; ok && e.seq == it.seq {
			return it, true
		}
		sh.order[sh.head] = orderItem{}
		sh.head++
	}
	return orderItem{}, false
}

// full reports whether the store holds its maximum of keys.
func (s *MemoryStore) full() bool {
	return s.tracked.Load() >= s.maxTracked.Load()
}

// over reports whether the store holds more keys than its bound.
func (s *MemoryStore) over() bool {
	return s.tracked.Load() > s.maxTracked.Load()
}

// purgeForRoom purges expired windows from every shard, unless another
// goroutine is at it or did it less than purgeEvery ago.
func (s *MemoryStore) purgeForRoom(t int64) {
	if t-s.purgedAt.Load() < int64(s.purgeEvery) || !s.purging.CompareAndSwap(false, true) {
		return
	}
	defer s.purging.Store(false)
	s.purgedAt.Store(t)
	s.Sweep(time.Unix(0, t))
}

// evictOldest evicts the shard's oldest inserted key, short or long, and
// reports whether there was one. The caller holds sh.mu.
func (sh *memShard) evictOldest(s *MemoryStore) bool {
	it, long := sh.oldestLong()
	at, seq, short := sh.short.oldest()
	switch {
	case short && (!long || widen(s.seq.Load(), seq) < it.seq>>slotBits):
		sh.short.remove(at)
	case long:
		sh.order[sh.head] = orderItem{}
		sh.head++
		delete(sh.entries[it.slot()], it.key)
		sh.compact()
	default:
		sh.compact()
		return false
	}
	s.tracked.Add(-1)
	s.evictions.Add(1)
	return true
}

// trimSlice is the most keys Trim evicts under one shard lock: a request
// waiting on that lock waits for no more than that many evictions.
const trimSlice = 128

// Trim brings a store above its bound (SetMaxTracked lowered it) down to
// it, off the request path: it purges the windows expired at now (unless a
// purge ran less than a second ago), then evicts the excess in slices of at
// most trimSlice keys, each under one shard's lock, the store's oldest keys
// first, until the store is within its bound or ctx is done. It returns how
// many live keys it evicted.
func (s *MemoryStore) Trim(ctx context.Context, now time.Time) int {
	if !s.over() {
		return 0
	}
	s.purgeForRoom(now.UnixNano())
	total := 0
	for ctx.Err() == nil {
		n := s.trimSome()
		if n == 0 {
			break
		}
		total += n
	}
	if total > 0 {
		// The tables, sized for the keys they had, are rebuilt for the
		// keys they kept. Rebuilt on the way down, they would be rebuilt
		// at sizes that are soon too large, each time under the lock.
		for i := range s.shards {
			sh := &s.shards[i]
			sh.mu.Lock()
			sh.short.tidy()
			sh.mu.Unlock()
		}
	}
	return total
}

// trimSome evicts one slice of the excess over the bound and returns how
// many keys it evicted: 0 when the store is within its bound (or empty).
// The slice is the store's oldest keys that one shard holds: its keys
// older than every other shard's oldest, at least one.
func (s *MemoryStore) trimSome() int {
	excess := s.tracked.Load() - s.maxTracked.Load()
	if excess <= 0 {
		return 0
	}
	idx, next := s.lockOldest()
	if idx < 0 {
		return 0
	}
	sh := &s.shards[idx]
	defer sh.mu.Unlock()
	slice := min(excess, trimSlice)
	n := 0
	for int64(n) < slice && (n == 0 || sh.oldestSeq(s.seq.Load()) < next) && sh.evictOldest(s) {
		n++
	}
	s.publish(idx)
	return n
}

// compact drops consumed and stale insertion records once they outnumber the
// live ones, keeping the order slice proportional to the shard. The caller
// holds sh.mu.
func (sh *memShard) compact() {
	size := 0
	for _, m := range sh.entries {
		size += len(m)
	}
	live := len(sh.order) - sh.head
	if live <= 2*size+64 && sh.head <= len(sh.order)/2 {
		return
	}
	kept := make([]orderItem, 0, size+size/4+16)
	for _, it := range sh.order[sh.head:] {
		if e, ok := sh.entries[it.slot()][it.key]; ok && e.seq == it.seq {
			kept = append(kept, it)
		}
	}
	sh.order, sh.head = kept, 0
}
