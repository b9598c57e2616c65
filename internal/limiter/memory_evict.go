package limiter

import (
	"context"
	"slices"
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

// insert adds e as the entry of the check's key, whose hash is h, evicting
// to make room when the store is full. The caller holds the shard's lock.
func (s *MemoryStore) insert(h uint64, c *Check, e *memEntry) {
	idx := h & s.mask
	sh := &s.shards[idx]
	for range insertEvictions {
		if !s.full() || !(sh.evictOldest(s) || s.evictElsewhere(idx)) {
			break
		}
	}
	sh.seq++
	s.tracked.Add(1)
	if k, short := packKey(c.Slot, c.Key); short {
		sh.short.add(uint32(h>>32), &k, e, uint32(sh.seq))
		return
	}
	m := sh.entries[c.Slot]
	if m == nil {
		m = make(map[string]memEntry)
		sh.entries[c.Slot] = m
	}
	key := strings.Clone(c.Key) // never pin the request's memory in the map
	e.seq = sh.seq<<slotBits | uint64(c.Slot)
	m[key] = *e
	sh.order = append(sh.order, orderItem{key: key, seq: e.seq})
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
	long := false
	var it orderItem
	for sh.head < len(sh.order) {
		it = sh.order[sh.head]
		if e, ok := sh.entries[it.slot()][it.key]; ok && e.seq == it.seq {
			long = true
			break
		}
		sh.order[sh.head] = orderItem{}
		sh.head++
	}
	at, seq, short := sh.short.oldest()
	switch {
	// The older is the one inserted more inserts ago. The inline table
	// keeps a seq's low 32 bits: a short key's age is exact while under
	// 2^32 inserts of its shard, a long key's always.
	case short && (!long || uint64(uint32(sh.seq)-seq) > sh.seq-it.seq>>slotBits):
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
// most trimSlice keys, each under one shard's lock, the oldest keys of each
// shard first, until the store is within its bound or ctx is done. It
// returns how many live keys it evicted.
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
	return total
}

// trimSome evicts one slice of the excess over the bound and returns how
// many keys it evicted: 0 when the store is within its bound (or empty).
// The slice comes from the shard holding the most keys, down towards the
// level at which the shards hold the bound between them: each shard keeps
// its newest keys, and about as many as the others, since the hash spreads
// new keys evenly. Without an order across shards, that is as near to the
// oldest keys of the store going first as FIFO kept per shard comes.
func (s *MemoryStore) trimSome() int {
	excess := s.tracked.Load() - s.maxTracked.Load()
	if excess <= 0 {
		return 0
	}
	var sizes [numShards]int
	largest := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		sizes[i] = sh.size()
		sh.mu.Unlock()
		if sizes[i] > sizes[largest] {
			largest = i
		}
	}
	level := waterLevel(sizes, int(s.maxTracked.Load()))
	sh := &s.shards[largest]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	slice := min(int64(max(sh.size()-level, 1)), excess, trimSlice)
	n := 0
	for ; int64(n) < slice && sh.evictOldest(s); n++ {
	}
	if n > 0 && (sh.size() <= level || !s.over()) {
		// The shard is trimmed: its table, sized for the keys it had, is
		// rebuilt for the keys it kept. Rebuilt on the way down, it would
		// be rebuilt at sizes that are soon too large, each time under
		// the lock.
		sh.short.tidy()
	}
	return n
}

// waterLevel returns the size to which cutting every larger shard leaves
// the shards holding bound keys between them, give or take one per shard.
func waterLevel(sizes [numShards]int, bound int) int {
	slices.Sort(sizes[:])
	rest := bound
	for i, n := range sizes {
		left := len(sizes) - i
		if level := (rest + left - 1) / left; n > level {
			return level
		}
		rest -= n
	}
	return sizes[len(sizes)-1]
}

// size returns how many keys the shard tracks. The caller holds sh.mu.
func (sh *memShard) size() int {
	n := sh.short.live
	for _, m := range sh.entries {
		n += len(m)
	}
	return n
}

// evictElsewhere evicts the oldest key of another shard, for a new key whose
// own shard is empty. The caller holds shard idx's lock, so it only tries the
// other locks: waiting on one could deadlock with a goroutine doing the same.
func (s *MemoryStore) evictElsewhere(idx uint64) bool {
	for j := uint64(1); j <= s.mask; j++ {
		o := &s.shards[(idx+j)&s.mask]
		if !o.mu.TryLock() {
			continue
		}
		ok := o.evictOldest(s)
		o.mu.Unlock()
		if ok {
			return true
		}
	}
	return false
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
