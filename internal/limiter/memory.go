package limiter

import (
	"context"
	"fmt"
	"hash/maphash"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
)

// MemoryStore is the in-process Store: fixed or sliding windows in a sharded
// hash map, bounded to a maximum number of tracked keys. When full it first
// purges expired windows, then evicts the keys it inserted first (FIFO,
// across the store: each shard publishes when its oldest key was inserted,
// and the oldest key of all goes). A bound lowered below the keys tracked is
// reached off the request path (Trim).
//
// A key of up to inlineMax bytes (every IPv4 address) is kept inline in the
// shard's open-addressing table, outside the Go heap; a longer one in a Go
// map. A Hit on a key already tracked is one hash, one shard lock and one
// lookup, and allocates nothing, nor does tracking a new short key; a
// Decide over n limits takes the n shard locks in ascending order, so that
// decisions never deadlock and each is atomic. The zero value is not
// usable; call NewMemoryStore. A MemoryStore is safe for concurrent use.
type MemoryStore struct {
	clock      clock.Clock // the sweeper's
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
	seq        atomic.Uint64 // the last insertion seq, counted across the store

	// oldest is the seq of each shard's oldest key (noKeys for none), so
	// that eviction finds the store's oldest key without locking every
	// shard. It is written under the shard's lock, by an insert into an
	// empty shard and after every removal (publish).
	oldest [numShards]atomic.Uint64

	namesMu sync.Mutex
	names   [MaxChecks]string // the limit name of each slot, for Range
	algos   [MaxChecks]int8   // how each slot counts as last configured: algoUnset, algoWindow or algoGCRA
}

// memShard holds the windows of the keys that hash to it: short keys in its
// inline table, longer ones in a map per limit slot with their insertion
// order beside. Both take their insertion seqs from the store's one
// counter, so that eviction takes the oldest of either, and of any shard.
type memShard struct {
	mu      sync.Mutex
	short   inlineTable                    // keys of at most inlineMax bytes, of every slot
	entries [MaxChecks]map[string]memEntry // longer keys by limit slot; nil until used
	bans    [MaxChecks]map[string]banEntry // banned keys by limit slot; nil until used
	flying  [MaxChecks]map[string]int32    // requests in flight by limit slot (MaxInFlight); nil until used
	order   []orderItem                    // insertion order of entries; live items start at head
	head    int
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
func NewMemoryStore(maxTracked int) *MemoryStore { return NewMemoryStoreClock(maxTracked, clock.Real) }

// NewMemoryStoreClock is NewMemoryStore with a sweeper that reads clk.
func NewMemoryStoreClock(maxTracked int, clk clock.Clock) *MemoryStore {
	s := &MemoryStore{
		clock:      clk,
		seed:       maphash.MakeSeed(),
		shards:     make([]memShard, numShards),
		mask:       numShards - 1,
		purgeEvery: time.Second,
		trimWake:   make(chan struct{}, 1),
	}
	for i := range s.shards {
		s.shards[i].entries[0] = make(map[string]memEntry)
		s.oldest[i].Store(noKeys)
	}
	s.SetMaxTracked(maxTracked)
	return s
}

// SetMaxTracked changes the bound on tracked keys. A bound below the keys
// tracked wakes the sweeper (Run), which evicts the excess in slices
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

// How a slot counts, as Configure last saw it.
const (
	algoUnset int8 = iota
	algoWindow
	algoGCRA
)

// Configure implements Store: it bounds the keys tracked and names each
// limit's slot, for Range. A slot given a new name, or whose limit changed
// to or from GCRA (a count read as an arrival time means nothing), forgets
// what it counted.
func (s *MemoryStore) Configure(st Settings) {
	s.SetMaxTracked(st.MaxTracked)
	for _, c := range st.Limits {
		algo := algoWindow
		if c.Limit.GCRA() {
			algo = algoGCRA
		}
		s.namesMu.Lock()
		old, was := s.names[c.Slot], s.algos[c.Slot]
		s.names[c.Slot], s.algos[c.Slot] = c.Name, algo
		s.namesMu.Unlock()
		if old != c.Name || was != algoUnset && was != algo {
			s.ClearSlot(c.Slot)
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
		s.publish(i)
		sh.mu.Unlock()
		s.tracked.Add(-int64(n))
		s.banned.Add(-int64(nb))
	}
}

// MaxTracked returns the bound on tracked keys.
func (s *MemoryStore) MaxTracked() int { return int(s.maxTracked.Load()) }

// Evictions implements Store: it returns how many live keys were evicted since the store was
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

// Hit decides one request against limit alone: Decide with one check in
// slot 0, of name "". It never returns an error.
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
	inserted := 0
	for i := range checks {
		if !found[i] && tracks(&checks[i], &es[i], t) {
			s.insert(hs[i], &checks[i], &es[i])
			inserted++
		}
	}
	s.unlockShards(locks[:nl])
	if inserted > 0 {
		s.makeRoom(inserted)
	}
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
	inserted := false
	if found {
		sh.put(at, c.Slot, c.Key, &e)
	} else if tracks(c, &e, t) {
		s.insert(h, c, &e)
		inserted = true
	}
	sh.mu.Unlock()
	if inserted {
		s.makeRoom(1)
	}
}

// judgement is what judge found of one check, for settle.
type judgement struct {
	countOK     bool  // the window admits the request
	full        bool  // the key's requests in flight fill the limit's MaxInFlight
	bannedUntil int64 // the key's ban in the limit ends then; 0 for none
}

// judge brings the check's entry (a new one when not found) to t and
// writes whether it admits the request to out. The caller holds the lock
// of shard sh.
func (s *MemoryStore) judge(sh *memShard, c *Check, e *memEntry, found bool, t int64, out *Verdict) judgement {
	switch {
	case !found:
		*e = memEntry{reset: t + int64(c.Limit.Window)}
		if c.Limit.Calendar != nil {
			e.reset = c.Limit.Calendar.End(t)
		}
		if c.Limit.GCRA() {
			e.reset = t // a full bucket
		} else if c.Limit.Sliding() {
			e.span = c.Limit.span()
		}
	case !c.Limit.GCRA():
		e.roll(t, &c.Limit)
	}
	var j judgement
	if c.force {
		j.countOK = true
		*out = Verdict{Max: c.Limit.Max, Reset: time.Unix(0, e.end(t, &c.Limit)), Allowed: true}
		return j
	}
	if c.Limit.Ban > 0 {
		if b, ok := sh.bans[c.Slot][c.Key]; ok && b.until > t {
			j.bannedUntil = b.until
		}
	}
	j.countOK = e.admits(t, c)
	j.full = c.MaxInFlight > 0 && sh.flying[c.Slot][c.Key] >= int32(c.MaxInFlight)
	*out = Verdict{Max: c.Limit.Max, Reset: time.Unix(0, e.end(t, &c.Limit)), Allowed: j.bannedUntil == 0 && j.countOK && !j.full}
	return j
}

// settle counts the check's request in its entry: spent when the decision
// (every check) admitted it, refused (and perhaps banned) when this check
// refused it; and completes out. The caller holds shard idx's lock.
func (s *MemoryStore) settle(idx uint64, c *Check, e *memEntry, t int64, allowed bool, j judgement, out *Verdict) {
	switch {
	case allowed:
		e.spend(t, c)
		if c.Limit.GCRA() {
			out.Reset = time.Unix(0, e.reset) // the bucket after this request
		}
		if c.MaxInFlight > 0 {
			s.shards[idx].takeSlot(c.Slot, c.Key)
		}
	case j.full && j.countOK && j.bannedUntil == 0:
		// Refused for the requests in flight alone: no violation, and
		// one of them may end any moment.
		out.InFlightFull, out.RetryAfter = true, time.Second
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
	return e.count > 0 || e.refused > 0 || (c.Limit.GCRA() && e.reset > t)
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
			case c.Limit.GCRA():
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

// Charge implements Store. It never returns an error.
func (s *MemoryStore) Charge(ctx context.Context, checks []Check, now time.Time, verdicts []Verdict) error {
	return charge(ctx, s, checks, now, verdicts)
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

// Len implements Store.
func (s *MemoryStore) Len() int { return int(s.tracked.Load()) }

// Interface guards
var _ Store = (*MemoryStore)(nil)
