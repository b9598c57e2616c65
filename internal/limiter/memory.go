package limiter

import (
	"context"
	"fmt"
	"hash/maphash"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// MemoryStore is the in-process Store: fixed or sliding windows in a sharded
// hash map, bounded to a maximum number of tracked keys. When full it first
// purges expired windows, then evicts the keys it inserted first (FIFO, kept
// per shard: the oldest key of the shard that needs room goes). A bound
// lowered below the keys tracked is reached off the request path (Trim).
//
// A key of up to inlineMax bytes (every IPv4 address) is kept inline in the
// shard's open-addressing table, outside the Go heap; a longer one in a Go
// map. A Hit on a key already tracked is one hash, one shard lock and one
// lookup, and allocates nothing, nor does tracking a new short key; a
// Decide over n limits takes the n shard locks in ascending order, so that
// decisions never deadlock and each is atomic. The zero value is not usable; call NewMemoryStore. A MemoryStore
// is safe for concurrent use.
type MemoryStore struct {
	seed       maphash.Seed
	shards     []memShard
	mask       uint64
	maxTracked atomic.Int64
	tracked    atomic.Int64
	banned     atomic.Int64 // ban entries, at most maxTracked
	evictions  atomic.Uint64
	purging    atomic.Bool
	purgedAt   atomic.Int64  // Unix nanoseconds of the last purge made for room
	purgeEvery time.Duration // least time between two purges made for room
	trimWake   chan struct{} // a lowered bound for the sweeper to reach; buffered 1

	namesMu sync.Mutex
	names   [MaxChecks]string // the limit name of each slot, for Range
}

// memEntry is one key's window in one limit: 32 bytes and no pointers, so a
// large map costs the garbage collector nothing to scan.
type memEntry struct {
	reset   int64 // Unix nanoseconds at which the window ends
	seq     uint64
	count   int32 // requests admitted in the window (max is at most 1e9)
	refused int32 // requests refused in the window, saturating
	prev    int32 // sliding: requests admitted in the previous window
	span    int32 // sliding: the window in seconds, kept while prev counts; 0 for fixed
}

// expires returns when the entry holds nothing that counts any more: the end
// of its window, or for a sliding window a window later, while its count
// still weighs on the next window.
func (e memEntry) expires() int64 {
	return e.reset + int64(e.span)*int64(time.Second)
}

// banEntry is a key's ban in one limit (Limit.Ban), kept apart from its
// window: a ban outlives the window, and a limit without bans pays nothing.
type banEntry struct {
	until   int64 // Unix nanoseconds at which the ban ends
	keep    int64 // Unix nanoseconds until which the entry is kept: the ban's end, or the strikes' memory
	strikes int32 // violations in a row, each within BanStrikeMemory of the one before
}

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

// memShard holds the windows of the keys that hash to it: short keys in its
// inline table, longer ones in a map per limit slot with their insertion
// order beside. Both share one insertion seq, so that eviction takes the
// oldest of either.
type memShard struct {
	mu      sync.Mutex
	short   inlineTable                    // keys of at most inlineMax bytes, of every slot
	entries [MaxChecks]map[string]memEntry // longer keys by limit slot; nil until used
	bans    [MaxChecks]map[string]banEntry // banned keys by limit slot; nil until used
	order   []orderItem                    // insertion order of entries; live items start at head
	head    int
	seq     uint64
	_       [64]byte // keep neighbouring shards' locks off one cache line
}

// find returns key's window in slot and where it is (for put and remove):
// a slot of the inline table, or -1 for the slot's map. h is the key's hash
// in slot (MemoryStore.hash).
func (sh *memShard) find(h uint64, slot int, key string) (e memEntry, at int, ok bool) {
	if k, short := packKey(slot, key); short {
		at, ok = sh.short.find(uint32(h>>32), &k)
		if ok {
			e = sh.short.slots[at].entry()
		}
		return e, at, ok
	}
	e, ok = sh.entries[slot][key]
	return e, -1, ok
}

// put writes back the window of a key that find found at at.
func (sh *memShard) put(at, slot int, key string, e *memEntry) {
	if at >= 0 {
		sh.short.slots[at].set(e)
		return
	}
	sh.entries[slot][key] = *e
}

// remove deletes a key that find found at at.
func (sh *memShard) remove(at, slot int, key string) {
	if at >= 0 {
		sh.short.remove(at)
		return
	}
	delete(sh.entries[slot], key)
}

// numShards is how many shards a MemoryStore has: enough that two cores,
// or many, rarely wait on one lock. A power of two, so that a hash's low
// bits pick one.
const numShards = 64

// NewMemoryStore returns a MemoryStore that tracks at most maxTracked keys
// (at least 1), give or take the number of keys being inserted at the same
// instant.
func NewMemoryStore(maxTracked int) *MemoryStore {
	s := &MemoryStore{
		seed:       maphash.MakeSeed(),
		shards:     make([]memShard, numShards),
		mask:       numShards - 1,
		purgeEvery: time.Second,
		trimWake:   make(chan struct{}, 1),
	}
	for i := range s.shards {
		s.shards[i].entries[0] = make(map[string]memEntry)
	}
	s.SetMaxTracked(maxTracked)
	return s
}

// SetMaxTracked changes the bound on tracked keys. A bound below the keys
// tracked wakes the sweeper (RunSweeper), which evicts the excess in slices
// (Trim); until it is done, each new key evicts insertEvictions keys, so the
// store shrinks and never grows, and no request waits on the whole excess.
func (s *MemoryStore) SetMaxTracked(maxTracked int) {
	s.maxTracked.Store(int64(max(maxTracked, 1)))
	if s.over() {
		select {
		case s.trimWake <- struct{}{}:
		default: // a wake is pending already
		}
	}
}

// SetSlotName names the limit counted in slot, for Range. A new name for a
// slot forgets what the slot counted under the old one.
func (s *MemoryStore) SetSlotName(slot int, name string) {
	s.namesMu.Lock()
	old := s.names[slot]
	s.names[slot] = name
	s.namesMu.Unlock()
	if old != name {
		s.ClearSlot(slot)
	}
}

// slotName returns the name of the limit counted in slot.
func (s *MemoryStore) slotName(slot int) string {
	s.namesMu.Lock()
	defer s.namesMu.Unlock()
	return s.names[slot]
}

// ClearSlot forgets every key counted in slot: its limit changed how it
// counts (to or from GCRA).
func (s *MemoryStore) ClearSlot(slot int) {
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n := len(sh.entries[slot])
		if slot == 0 {
			clear(sh.entries[0])
		} else {
			sh.entries[slot] = nil
		}
		for j := range sh.short.slots {
			if k := &sh.short.slots[j].key; k.live() && k.slot() == slot {
				sh.short.remove(j)
				n++
			}
		}
		sh.short.tidy()
		nb := len(sh.bans[slot])
		sh.bans[slot] = nil
		sh.compact()
		sh.mu.Unlock()
		s.tracked.Add(-int64(n))
		s.banned.Add(-int64(nb))
	}
}

// MaxTracked returns the bound on tracked keys.
func (s *MemoryStore) MaxTracked() int { return int(s.maxTracked.Load()) }

// Evictions returns how many live keys were evicted since the store was
// created, to make room for new ones or to reach a lowered bound (Trim).
// Expired windows purged are not counted.
func (s *MemoryStore) Evictions() uint64 { return s.evictions.Load() }

// slotSalts spread one key's limits over different shards.
var slotSalts = [MaxChecks]uint64{0, 0x9e3779b97f4a7c15, 0xbf58476d1ce4e5b9, 0x94d049bb133111eb, 0x2545f4914f6cdd1d, 0x853c49e6748fea9b, 0xda942042e4dd58b5, 0xa0761d6478bd642f}

// hash returns key's hash in slot; its low bits pick the shard, its high
// bits the place in the shard's inline table.
func (s *MemoryStore) hash(key string, slot int) uint64 {
	return maphash.String(s.seed, key) ^ slotSalts[slot]
}

// Hit implements Store. It never returns an error.
func (s *MemoryStore) Hit(ctx context.Context, key string, now time.Time, limit Limit) (Verdict, error) {
	// Not a shared helper taking s.Decide as a func value: through one,
	// the check and verdict escape to the heap on every call.
	var out [1]Verdict
	err := s.Decide(ctx, []Check{{Key: key, Limit: limit}}, now, out[:])
	return out[0], err
}

// Decide implements Store. It fails only for more than MaxChecks checks or a
// slot out of range.
func (s *MemoryStore) Decide(_ context.Context, checks []Check, now time.Time, out []Verdict) error {
	n := len(checks)
	if n > MaxChecks || len(out) < n {
		return fmt.Errorf("memory store: %d checks for %d verdicts, at most %d", n, len(out), MaxChecks)
	}
	for i := range checks {
		if c := &checks[i]; c.Slot < 0 || c.Slot >= MaxChecks {
			return fmt.Errorf("memory store: check slot %d out of range", c.Slot)
		}
	}
	if n == 1 {
		s.decideOne(&checks[0], now.UnixNano(), &out[0])
	} else {
		s.decideMany(checks, now.UnixNano(), out)
	}
	return nil
}

// decideMany is Decide for several checks, in a function of its own: its
// arrays would make Decide's frame, which every decision pays for, large
// enough to grow request goroutines' stacks under load.
func (s *MemoryStore) decideMany(checks []Check, t int64, out []Verdict) {
	n := len(checks)
	var hs, idx, locks [MaxChecks]uint64
	for i := range checks {
		hs[i] = s.hash(checks[i].Key, checks[i].Slot)
		idx[i] = hs[i] & s.mask
	}
	nl := sortedUnique(idx[:n], locks[:])

	var es [MaxChecks]memEntry
	var found [MaxChecks]bool
	var at [MaxChecks]int
	s.lockShards(locks[:nl])
	missing := false
	for i := range checks {
		c := &checks[i]
		es[i], at[i], found[i] = s.shards[idx[i]].find(hs[i], c.Slot, c.Key)
		missing = missing || !found[i]
	}
	if missing && s.full() {
		// Purging scans every shard, so it runs with no lock held.
		s.unlockShards(locks[:nl])
		s.purgeForRoom(t)
		s.lockShards(locks[:nl])
		for i := range checks {
			c := &checks[i]
			es[i], at[i], found[i] = s.shards[idx[i]].find(hs[i], c.Slot, c.Key)
		}
	}

	allowed := true
	var js [MaxChecks]judgement
	for i := range checks {
		js[i] = s.judge(&s.shards[idx[i]], &checks[i], &es[i], found[i], t, &out[i])
		allowed = allowed && out[i].Allowed
	}
	for i := range checks {
		c := &checks[i]
		s.settle(idx[i], c, &es[i], t, allowed, js[i], &out[i])
		if found[i] {
			// Written back before any insertion below, which is what may
			// evict or move it: the key is still where find found it.
			s.shards[idx[i]].put(at[i], c.Slot, c.Key, &es[i])
		}
	}
	for i := range checks {
		if !found[i] && tracks(&checks[i], &es[i], t) {
			s.insert(hs[i], &checks[i], &es[i])
		}
	}
	s.unlockShards(locks[:nl])
}

// decideOne is Decide for one check, the common case: one shard, one lock,
// and none of the arrays a decision over several limits needs.
func (s *MemoryStore) decideOne(c *Check, t int64, out *Verdict) {
	h := s.hash(c.Key, c.Slot)
	idx := h & s.mask
	sh := &s.shards[idx]
	sh.mu.Lock()
	e, at, found := sh.find(h, c.Slot, c.Key)
	if !found && s.full() {
		sh.mu.Unlock() // purging scans every shard, with no lock held
		s.purgeForRoom(t)
		sh.mu.Lock()
		e, at, found = sh.find(h, c.Slot, c.Key)
	}
	j := s.judge(sh, c, &e, found, t, out)
	s.settle(idx, c, &e, t, out.Allowed, j, out)
	if found {
		sh.put(at, c.Slot, c.Key, &e)
	} else if tracks(c, &e, t) {
		s.insert(h, c, &e)
	}
	sh.mu.Unlock()
}

// judgement is what judge found of one check, for settle.
type judgement struct {
	countOK     bool  // the window admits the request
	bannedUntil int64 // the key's ban in the limit ends then; 0 for none
}

// judge brings the check's entry (a new one when not found) to t and
// writes whether it admits the request to out. The caller holds the lock
// of shard sh.
func (s *MemoryStore) judge(sh *memShard, c *Check, e *memEntry, found bool, t int64, out *Verdict) judgement {
	switch {
	case !found:
		*e = memEntry{reset: t + int64(c.Limit.Window)}
		if c.Limit.GCRA {
			e.reset = t // a full bucket
		} else if c.Limit.Sliding {
			e.span = int32(c.Limit.Window / time.Second)
		}
	case !c.Limit.GCRA:
		e.roll(t, &c.Limit)
	}
	var j judgement
	if c.Limit.Ban > 0 {
		if b, ok := sh.bans[c.Slot][c.Key]; ok && b.until > t {
			j.bannedUntil = b.until
		}
	}
	j.countOK = e.admits(t, c)
	*out = Verdict{Max: c.Limit.Max, Reset: time.Unix(0, e.end(t, &c.Limit)), Allowed: j.bannedUntil == 0 && j.countOK}
	return j
}

// settle counts the check's request in its entry: spent when the decision
// (every check) admitted it, refused (and perhaps banned) when this check
// refused it; and completes out. The caller holds shard idx's lock.
func (s *MemoryStore) settle(idx uint64, c *Check, e *memEntry, t int64, allowed bool, j judgement, out *Verdict) {
	switch {
	case allowed:
		e.spend(t, c)
		if c.Limit.GCRA {
			out.Reset = time.Unix(0, e.reset) // the bucket after this request
		}
	case !out.Allowed:
		if e.refused < math.MaxInt32 {
			e.refused++
		}
		out.FirstRefusal = e.refused == 1
		if !j.countOK {
			out.RetryAfter = e.wait(t, c)
		}
		if c.Limit.Ban > 0 {
			// A violation: the count refuses a request of one unit
			// (a costly request that does not fit is no violation).
			if j.bannedUntil == 0 && !e.admits(t, &Check{Limit: c.Limit}) {
				if c.NoBan {
					out.PendingBan = true
				} else {
					j.bannedUntil = s.ban(idx, c, t)
				}
			}
			if j.bannedUntil > t {
				// Refused until the ban ends, and the window admits.
				out.RetryAfter = max(out.RetryAfter, time.Duration(j.bannedUntil-t))
				out.Reset = time.Unix(0, t+int64(out.RetryAfter))
			}
		}
	}
	out.Remaining = e.remaining(t, c)
	if j.bannedUntil > t {
		out.Remaining = 0
	}
}

// tracks reports whether a new key's entry is worth keeping: a new key that
// counted nothing (another limit refused the request) would only take room.
func tracks(c *Check, e *memEntry, t int64) bool {
	return e.count > 0 || e.refused > 0 || (c.Limit.GCRA && e.reset > t)
}

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

// roll moves the entry to the window holding t: a fixed window that has
// ended starts afresh; a sliding one keeps the count of the window just
// ended as prev. A window a reload shortened is cut first (Limit.end).
func (e *memEntry) roll(t int64, l *Limit) {
	e.reset = l.End(e.reset, t)
	if t < e.reset {
		return
	}
	w := int64(l.Window)
	if l.Sliding && t < e.reset+w {
		e.prev = e.count
		e.reset += w
	} else {
		e.prev = 0
		e.reset = t + w
	}
	e.count, e.refused = 0, 0
	e.span = 0
	if l.Sliding {
		e.span = int32(l.Window / time.Second)
	}
}

// admits reports whether the check's request (its cost) fits the entry's
// window at t.
func (e *memEntry) admits(t int64, c *Check) bool {
	l := &c.Limit
	switch {
	case l.GCRA:
		// A cost over the burst never fits (and would overflow below).
		return c.cost() <= l.burst() && max(e.reset, t)+c.cost()*l.interval()-t <= l.burst()*l.interval()
	case l.Sliding:
		return l.sliding(int64(e.prev), int64(e.count), e.reset, t)+float64(c.cost()) <= float64(l.Max)
	}
	return int64(e.count)+c.cost() <= int64(l.Max)
}

// spend counts the check's admitted request in the entry.
func (e *memEntry) spend(t int64, c *Check) {
	if c.Limit.GCRA {
		e.reset = max(e.reset, t) + c.cost()*c.Limit.interval()
		e.refused = 0
		return
	}
	e.count = int32(min(int64(e.count)+c.cost(), math.MaxInt32))
}

// end returns when the entry's window ends; for GCRA, when its bucket is
// full again.
func (e *memEntry) end(t int64, l *Limit) int64 {
	if l.GCRA {
		return max(e.reset, t)
	}
	return e.reset
}

// remaining returns how many more requests fit the entry's window at t.
func (e *memEntry) remaining(t int64, c *Check) int {
	l := &c.Limit
	switch {
	case l.GCRA:
		return int(max((l.burst()*l.interval()-(max(e.reset, t)-t))/l.interval(), 0))
	case l.Sliding:
		return int(max(float64(l.Max)-math.Ceil(l.sliding(int64(e.prev), int64(e.count), e.reset, t)), 0))
	}
	return int(max(int64(l.Max)-int64(e.count), 0))
}

// wait returns how long a refused key waits at t until its request fits.
func (e *memEntry) wait(t int64, c *Check) time.Duration {
	l := &c.Limit
	switch {
	case l.GCRA:
		if c.cost() > l.burst() {
			return l.Window // it never fits
		}
		return time.Duration(max(max(e.reset, t)+c.cost()*l.interval()-t-l.burst()*l.interval(), 1))
	case l.Sliding:
		return max(l.slidingWait(int64(e.prev), int64(e.count), e.reset, t, c.cost()), 1)
	}
	return time.Duration(e.reset - t)
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

// Refund implements Store. It never returns an error.
func (s *MemoryStore) Refund(_ context.Context, checks []Check, now time.Time, verdicts []Verdict) error {
	for i := range checks {
		c := &checks[i]
		if i >= len(verdicts) || !verdicts[i].Allowed || c.Slot < 0 || c.Slot >= MaxChecks {
			continue
		}
		h := s.hash(c.Key, c.Slot)
		sh := &s.shards[h&s.mask]
		sh.mu.Lock()
		if e, at, ok := sh.find(h, c.Slot, c.Key); ok {
			switch {
			case c.Limit.GCRA:
				// Only what has not dripped back yet: the request's
				// units left in the bucket it left behind.
				e.reset -= gcraBack(c, verdicts[i], now)
			case e.reset == verdicts[i].Reset.UnixNano(): // the same window
				e.count = int32(max(int64(e.count)-c.cost(), 0))
			}
			sh.put(at, c.Slot, c.Key, &e)
		}
		sh.mu.Unlock()
	}
	return nil
}

// sortedUnique writes the distinct values of idx to out in ascending order
// and returns how many there are. idx holds at most MaxChecks values.
func sortedUnique(idx []uint64, out []uint64) int {
	n := 0
	for _, v := range idx {
		j := n
		for j > 0 && out[j-1] > v {
			j--
		}
		if j > 0 && out[j-1] == v {
			continue
		}
		copy(out[j+1:n+1], out[j:n])
		out[j] = v
		n++
	}
	return n
}

func (s *MemoryStore) lockShards(idx []uint64) {
	for _, i := range idx {
		s.shards[i].mu.Lock()
	}
}

func (s *MemoryStore) unlockShards(idx []uint64) {
	for j := len(idx) - 1; j >= 0; j-- {
		s.shards[idx[j]].mu.Unlock()
	}
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

// purge deletes every expired window of the shard and returns how many it
// deleted. The caller holds sh.mu.
func (sh *memShard) purge(t int64) int {
	n := 0
	for _, m := range sh.entries {
		for k, e := range m {
			if t >= e.expires() {
				delete(m, k)
				n++
			}
		}
	}
	if n > 0 {
		sh.compact()
	}
	for i := range sh.short.slots {
		if sl := &sh.short.slots[i]; sl.key.live() && t >= sl.entry().expires() {
			sh.short.remove(i)
			n++
		}
	}
	sh.short.tidy()
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

// Len implements Store.
func (s *MemoryStore) Len() int { return int(s.tracked.Load()) }

// RangeLen implements RangeSizer: the windows tracked plus the bans, since
// Range lists a ban on its own once its window has ended.
func (s *MemoryStore) RangeLen() int { return int(s.tracked.Load() + s.banned.Load()) }

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
			ks := KeyState{Key: k, Count: int(e.count), Refused: int(e.refused), Reset: time.Unix(0, e.reset), Prev: int(e.prev), Name: names[slot]}
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
	}
	if _, banned := sh.bans[c.Slot][c.Key]; banned {
		delete(sh.bans[c.Slot], c.Key)
		s.banned.Add(-1)
		ok = true
	}
	sh.mu.Unlock()
	return ok, nil
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

// CutWindows ends every window of the limit in slot that would end after
// cutoff at cutoff: a reload shortened the limit's window.
func (s *MemoryStore) CutWindows(slot int, cutoff time.Time) {
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

// Sweep purges every window expired at now, one shard at a time, and returns
// how many keys it dropped.
func (s *MemoryStore) Sweep(now time.Time) int {
	t := now.UnixNano()
	total := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n := sh.purge(t)
		sh.purgeBans(s, t, false)
		sh.compact()
		sh.mu.Unlock()
		s.tracked.Add(-int64(n))
		total += n
	}
	return total
}

// RunSweeper calls Sweep every interval(), give or take a tenth at random so
// that zones created together do not sweep together, and Trim whenever
// SetMaxTracked lowers the bound below the keys tracked, until ctx is done.
// interval is read before each wait, so a caller can change it while the
// sweeper runs; a non-positive interval stops the sweeper.
func (s *MemoryStore) RunSweeper(ctx context.Context, interval func() time.Duration) {
	for {
		interval := interval()
		if interval <= 0 {
			return
		}
		jitter := time.Duration(rand.Int64N(int64(interval)/5+1)) - interval/10
		if !s.sweepAfter(ctx, interval+jitter) {
			return
		}
	}
}

// sweepAfter waits d and sweeps, trimming the store whenever it is woken
// meanwhile (a trim does not put the sweep off). It reports false when ctx
// ended first.
func (s *MemoryStore) sweepAfter(ctx context.Context, d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-s.trimWake:
			s.Trim(ctx, time.Now())
		case now := <-timer.C:
			s.Sweep(now)
			return true
		}
	}
}

// Interface guards
var (
	_ Store      = (*MemoryStore)(nil)
	_ RangeSizer = (*MemoryStore)(nil)
)
