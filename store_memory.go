package ratelimit

import (
	"context"
	"hash/maphash"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// MemoryStore is the in-process Store: fixed windows in a sharded hash map,
// bounded to a maximum number of tracked keys. When full it first purges
// expired windows, then evicts the keys it inserted first (FIFO, kept per
// shard: the oldest key of the shard that needs room goes).
//
// A Hit on a key already tracked is one hash, one shard lock and one map
// lookup, and allocates nothing. The zero value is not usable; call
// NewMemoryStore. A MemoryStore is safe for concurrent use.
type MemoryStore struct {
	seed       maphash.Seed
	shards     []memShard
	mask       uint64
	maxTracked atomic.Int64
	tracked    atomic.Int64
	evictions  atomic.Uint64
	purging    atomic.Bool
	purgedAt   atomic.Int64  // Unix nanoseconds of the last purge made for room
	purgeEvery time.Duration // least time between two purges made for room
}

// memEntry is one key's fixed window: 32 bytes and no pointers, so a large
// map costs the garbage collector nothing to scan.
type memEntry struct {
	reset   int64 // Unix nanoseconds at which the window ends
	count   int64 // requests admitted in the window
	refused int64 // requests refused in the window
	seq     uint64
}

// orderItem records one insertion; an item whose seq no longer matches the
// entry's is stale (the key was purged, forgotten or re-inserted).
type orderItem struct {
	key string
	seq uint64
}

type memShard struct {
	mu      sync.Mutex
	entries map[string]memEntry
	order   []orderItem // insertion order; live items start at head
	head    int
	seq     uint64
	_       [64]byte // keep neighbouring shards' locks off one cache line
}

// NewMemoryStore returns a MemoryStore that tracks at most maxTracked keys
// (at least 1), give or take the number of keys being inserted at the same
// instant.
func NewMemoryStore(maxTracked int) *MemoryStore {
	n := 64 // enough shards that two cores, or many, rarely wait on one lock
	s := &MemoryStore{
		seed:       maphash.MakeSeed(),
		shards:     make([]memShard, n),
		mask:       uint64(n - 1),
		purgeEvery: time.Second,
	}
	for i := range s.shards {
		s.shards[i].entries = make(map[string]memEntry)
	}
	s.SetMaxTracked(maxTracked)
	return s
}

// SetMaxTracked changes the bound on tracked keys. A lower bound is enforced
// as new keys arrive; keys already tracked stay until then.
func (s *MemoryStore) SetMaxTracked(maxTracked int) {
	s.maxTracked.Store(int64(max(maxTracked, 1)))
}

// MaxTracked returns the bound on tracked keys.
func (s *MemoryStore) MaxTracked() int { return int(s.maxTracked.Load()) }

// Evictions returns how many live keys were evicted to make room for new ones
// since the store was created. Expired windows purged are not counted.
func (s *MemoryStore) Evictions() uint64 { return s.evictions.Load() }

func (s *MemoryStore) shardIndex(key string) uint64 {
	return maphash.String(s.seed, key) & s.mask
}

// Hit implements Store. It never returns an error.
func (s *MemoryStore) Hit(_ context.Context, key string, now time.Time, limit Limit) (Verdict, error) {
	t := now.UnixNano()
	idx := s.shardIndex(key)
	sh := &s.shards[idx]
	sh.mu.Lock()
	e, ok := sh.entries[key]
	if !ok && s.full() {
		// Purging scans every shard, so it runs with no lock held.
		sh.mu.Unlock()
		s.purgeForRoom(t)
		sh.mu.Lock()
		e, ok = sh.entries[key]
	}
	if !ok {
		key = strings.Clone(key) // never pin the request's memory in the map
		for s.full() && (sh.evictOldest(s) || s.evictElsewhere(idx)) {
		}
		sh.seq++
		e.seq = sh.seq
		e.reset = t + int64(limit.Window)
		sh.order = append(sh.order, orderItem{key: key, seq: e.seq})
		s.tracked.Add(1)
	} else if e.reset = limit.end(e.reset, t); t >= e.reset {
		e.count, e.refused = 0, 0
		e.reset = t + int64(limit.Window)
	}
	v := Verdict{Limit: limit.Max}
	if e.count < int64(limit.Max) {
		e.count++
		v.Allowed = true
	} else {
		e.refused++
		v.FirstRefusal = e.refused == 1
	}
	sh.entries[key] = e
	sh.mu.Unlock()

	v.Remaining = int(max(int64(limit.Max)-e.count, 0))
	v.Reset = time.Unix(0, e.reset)
	if !v.Allowed {
		v.RetryAfter = time.Duration(e.reset - t)
	}
	return v, nil
}

// full reports whether the store holds its maximum of keys.
func (s *MemoryStore) full() bool {
	return s.tracked.Load() >= s.maxTracked.Load()
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

// evictOldest evicts the shard's oldest inserted key and reports whether
// there was one. The caller holds sh.mu.
func (sh *memShard) evictOldest(s *MemoryStore) bool {
	for sh.head < len(sh.order) {
		it := sh.order[sh.head]
		sh.order[sh.head] = orderItem{}
		sh.head++
		if e, ok := sh.entries[it.key]; ok && e.seq == it.seq {
			delete(sh.entries, it.key)
			s.tracked.Add(-1)
			s.evictions.Add(1)
			sh.compact()
			return true
		}
	}
	sh.compact()
	return false
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

// purge deletes every expired window of the shard and returns how many it
// deleted. The caller holds sh.mu.
func (sh *memShard) purge(t int64) int {
	n := 0
	for k, e := range sh.entries {
		if t >= e.reset {
			delete(sh.entries, k)
			n++
		}
	}
	if n > 0 {
		sh.compact()
	}
	return n
}

// compact drops consumed and stale insertion records once they outnumber the
// live ones, keeping the order slice proportional to the shard. The caller
// holds sh.mu.
func (sh *memShard) compact() {
	live := len(sh.order) - sh.head
	if live <= 2*len(sh.entries)+64 && sh.head <= len(sh.order)/2 {
		return
	}
	kept := make([]orderItem, 0, len(sh.entries)+len(sh.entries)/4+16)
	for _, it := range sh.order[sh.head:] {
		if e, ok := sh.entries[it.key]; ok && e.seq == it.seq {
			kept = append(kept, it)
		}
	}
	sh.order, sh.head = kept, 0
}

// Len implements Store.
func (s *MemoryStore) Len() int { return int(s.tracked.Load()) }

// Range implements Store. It copies one shard at a time under that shard's
// lock and calls fn with no lock held.
func (s *MemoryStore) Range(ctx context.Context, now time.Time, fn func(KeyState) bool) error {
	t := now.UnixNano()
	var batch []KeyState
	for i := range s.shards {
		if err := ctx.Err(); err != nil {
			return err
		}
		sh := &s.shards[i]
		batch = batch[:0]
		sh.mu.Lock()
		for k, e := range sh.entries {
			if t < e.reset {
				batch = append(batch, KeyState{Key: k, Count: int(e.count), Refused: int(e.refused), Reset: time.Unix(0, e.reset)})
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

// Forget implements Store. It never returns an error.
func (s *MemoryStore) Forget(_ context.Context, key string) (bool, error) {
	sh := &s.shards[s.shardIndex(key)]
	sh.mu.Lock()
	_, ok := sh.entries[key]
	if ok {
		delete(sh.entries, key)
		s.tracked.Add(-1)
	}
	sh.mu.Unlock()
	return ok, nil
}

// CutWindows ends every window that would end after cutoff at cutoff: a
// reload shortened the window.
func (s *MemoryStore) CutWindows(cutoff time.Time) {
	c := cutoff.UnixNano()
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for k, e := range sh.entries {
			if e.reset > c {
				e.reset = c
				sh.entries[k] = e
			}
		}
		sh.mu.Unlock()
	}
}

// Sweep purges every window expired at now, one shard at a time, and returns
// how many keys it dropped.
func (s *MemoryStore) Sweep(now time.Time) int {
	t := now.UnixNano()
	total := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n := sh.purge(t)
		sh.compact()
		sh.mu.Unlock()
		s.tracked.Add(-int64(n))
		total += n
	}
	return total
}

// RunSweeper calls Sweep every interval(), give or take a tenth at random so
// that zones created together do not sweep together, until ctx is done.
// interval is read before each wait, so a caller can change it while the
// sweeper runs; a non-positive interval stops the sweeper.
func (s *MemoryStore) RunSweeper(ctx context.Context, interval func() time.Duration) {
	for {
		interval := interval()
		if interval <= 0 {
			return
		}
		jitter := time.Duration(rand.Int64N(int64(interval)/5+1)) - interval/10
		timer := time.NewTimer(interval + jitter)
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case now := <-timer.C:
			s.Sweep(now)
		}
	}
}

// Interface guards
var _ Store = (*MemoryStore)(nil)
