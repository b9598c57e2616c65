package limiter

import (
	"math/bits"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The sync table's entries live outside the Go heap, as the memory store's
// short keys do (arena): each shard hands its entries out of chunks that
// never move, and finds them through an open-addressing index of their
// numbers. An entry holds no pointer (its key is inline, or for a long key
// in the shard's map of long keys), so the collector neither scans the
// table nor counts it towards its next goal.

const (
	// syncKeyInline is the longest key (cacheKey) an entry holds inline.
	syncKeyInline = 32
	// syncLongKey is what an entry's ckLen holds for a key too long to be
	// inline.
	syncLongKey = 255
	// syncChunk0 is how many entries a shard's first chunk holds; each
	// chunk after it holds twice as many as the one before.
	syncChunk0 = 16
	// syncMaxChunks is how many chunks entry numbers (uint32) can fill.
	syncMaxChunks = 28
	// syncDeleted marks an index slot whose entry was removed.
	syncDeleted = ^uint64(0)
)

// syncPlace names an entry of any shard past the shards' locks (the
// table's fifo, a round's items): its shard and a reference in it, which
// the entry's removal makes stale, even once its memory holds another
// key. It holds no pointer, so the collector has nothing to scan in the
// fifo.
type syncPlace struct {
	syncRef
	shard uint8
}

// place returns e's place, for the table's fifo.
func (e *syncEntry) place() syncPlace { return syncPlace{e.ref(), e.shard} }

// syncRef names an entry of one shard's slab in the shard's own lists
// (touched, leased), which are read under the shard's lock only: its
// number and its generation.
type syncRef struct {
	num, gen uint32
}

// ref returns a reference to e, for its own shard's lists.
func (e *syncEntry) ref() syncRef { return syncRef{e.num, e.gen.Load()} }

// held returns the entry r names, and whether it is still that entry: its
// memory may hold another key since. The shard is locked.
func (sl *syncSlab) held(r syncRef) (*syncEntry, bool) {
	e := sl.at(r.num)
	return e, e.gen.Load() == r.gen
}

// syncSlab is one shard's entries and their index. The shard's lock
// guards it.
type syncSlab struct {
	// chunks[k] holds syncChunk0 << k entries, once the entries before
	// them are handed out. Each is set once, before any entry of it is
	// named anywhere, and never moves: at reads it without the lock for
	// an entry a syncPlace names (trim, sweep).
	chunks [syncMaxChunks][]syncEntry
	mems   []*arena // the chunks' memory
	n      uint32   // entries handed out of the chunks, the removed ones too
	free   []uint32 // the numbers of removed entries, to reuse
	// index holds, for each entry in the table, its hash in the high
	// half and its number + 1 in the low; 0 is a free slot, syncDeleted
	// one whose entry was removed.
	index      []uint64
	indexMem   *arena
	live, used int               // entries in the table; index slots not free
	long       map[uint32]string // keys longer than syncKeyInline, by number
	tags       map[uint32]string // keys' names in Redis when hashed (hash_keys), by number
}

// at returns entry number i.
func (sl *syncSlab) at(i uint32) *syncEntry {
	k := chunkOf(i)
	return &sl.chunks[k][i-syncChunk0*(1<<k-1)]
}

// chunkOf returns the number of the chunk that holds entry number i.
func chunkOf(i uint32) int { return bits.Len32(i/syncChunk0+1) - 1 }

// find returns the entry of key ck, whose hash is h, or nil.
func (sl *syncSlab) find(h uint32, ck string) *syncEntry {
	n := len(sl.index)
	if n == 0 {
		return nil
	}
	for i := home(h, n); ; {
		v := sl.index[i]
		if v == 0 {
			return nil
		}
		if v != syncDeleted && uint32(v>>32) == h {
			if e := sl.at(uint32(v) - 1); sl.is(e, ck) {
				return e
			}
		}
		if i++; i == n {
			i = 0
		}
	}
}

// is reports whether e's key is ck.
func (sl *syncSlab) is(e *syncEntry, ck string) bool {
	if len(ck) > syncKeyInline {
		return e.ckLen == syncLongKey && sl.long[e.num] == ck
	}
	return int(e.ckLen) == len(ck) && string(e.ck[:len(ck)]) == ck
}

// add returns a new entry of key ck, whose hash is h, which is not in the
// table: zero but for its key.
func (sl *syncSlab) add(h uint32, ck string) *syncEntry {
	var e *syncEntry
	if k := len(sl.free); k > 0 {
		e = sl.at(sl.free[k-1])
		sl.free = sl.free[:k-1]
	} else {
		if k := chunkOf(sl.n); sl.chunks[k] == nil {
			size := syncChunk0 << k
			mem := newArena(size * int(unsafe.Sizeof(syncEntry{})))
			sl.chunks[k] = unsafe.Slice((*syncEntry)(unsafe.Pointer(unsafe.SliceData(mem.b))), size)
			sl.mems = append(sl.mems, mem)
		}
		e = sl.at(sl.n)
		e.num = sl.n
		e.gen.Store(1) // a hold of generation 0 is of no entry
		sl.n++
	}
	e.hash, e.ckLen, e.live = h, uint8(len(ck)), true
	if len(ck) > syncKeyInline {
		e.ckLen = syncLongKey
		if sl.long == nil {
			sl.long = make(map[uint32]string)
		}
		sl.long[e.num] = strings.Clone(ck) // not a part of a larger string the request holds
	} else {
		copy(e.ck[:], ck)
	}
	if (sl.used+1)*100 > len(sl.index)*maxLoad {
		sl.rehash(max(minInlineSz, (sl.live+1)*100/growLoad))
	}
	i := sl.slotFree(h)
	if sl.index[i] == 0 {
		sl.used++
	}
	sl.index[i] = uint64(h)<<32 | uint64(e.num+1)
	sl.live++
	return e
}

// remove takes e out of the table: its references go stale, and its memory
// goes to the next entry added.
func (sl *syncSlab) remove(e *syncEntry) {
	n := len(sl.index)
	for i := home(e.hash, n); ; {
		if sl.index[i] != syncDeleted && uint32(sl.index[i]) == e.num+1 {
			sl.index[i] = syncDeleted
			break
		}
		if i++; i == n {
			i = 0
		}
	}
	sl.live--
	if sl.long != nil {
		delete(sl.long, e.num)
	}
	if sl.tags != nil {
		delete(sl.tags, e.num)
	}
	e.gen.Add(1)
	e.syncWindow = syncWindow{}
	e.hash, e.ckLen, e.nameLen, e.live = 0, 0, 0, false
	sl.free = append(sl.free, e.num)
}

// slotFree returns the first index slot on the probe path of hash h that
// holds no entry. The index has room.
func (sl *syncSlab) slotFree(h uint32) int {
	n := len(sl.index)
	i := home(h, n)
	for sl.index[i] != 0 && sl.index[i] != syncDeleted {
		if i++; i == n {
			i = 0
		}
	}
	return i
}

// rehash moves the index to n slots or more, without the deleted ones.
func (sl *syncSlab) rehash(n int) {
	old, oldMem := sl.index, sl.indexMem
	n = max(n, sl.live*100/maxLoad+1)
	sl.indexMem = newArena(n * 8)
	sl.index = unsafe.Slice((*uint64)(unsafe.Pointer(unsafe.SliceData(sl.indexMem.b))), n)
	sl.used = 0
	for _, v := range old {
		if v != 0 && v != syncDeleted {
			sl.index[sl.slotFree(uint32(v>>32))] = v
			sl.used++
		}
	}
	if oldMem != nil {
		oldMem.free()
	}
}

// each calls fn with every entry in the table, until it returns false; fn
// may remove the entry it is given.
func (sl *syncSlab) each(fn func(e *syncEntry) bool) {
	for i := range sl.n {
		if e := sl.at(i); e.live && !fn(e) {
			return
		}
	}
}

// tidy shrinks an index that deleted slots lengthen or that has far more
// room than entries. The chunks stay: holds may point into them (the
// entries of keys removed go to the next keys added).
func (sl *syncSlab) tidy() {
	if n := len(sl.index); n > 0 && ((sl.used-sl.live)*4 > n || (n > 4*minInlineSz && sl.live*4 < n)) {
		sl.rehash(max(minInlineSz, sl.live*100/growLoad))
	}
}

// ckOf returns e's key (cacheKey), a copy that outlives the entry.
func (sl *syncSlab) ckOf(e *syncEntry) string {
	if e.ckLen == syncLongKey {
		return sl.long[e.num]
	}
	return string(e.ck[:e.ckLen])
}

// parts returns the name of e's limit and e's key, the two parts of its
// cacheKey, from one copy of it.
func (sl *syncSlab) parts(e *syncEntry) (name, key string) {
	ck := sl.ckOf(e)
	if e.nameLen == 0 {
		return "", ck
	}
	return ck[:e.nameLen], ck[e.nameLen+1:]
}

// key returns e's key.
func (sl *syncSlab) key(e *syncEntry) string {
	_, key := sl.parts(e)
	return key
}

// calendarRef names a calendar of calendars (0: none), so that an entry
// holds no pointer to it.
type calendarRef uint16

// calendars are the calendars sync entries have named, each once by unit
// and time zone (by its name: the module loads each zone by name, so a
// reload's calendars take the refs of the last's): at most four units for
// each of the time zones there are.
var calendars struct {
	mu  sync.Mutex
	all atomic.Pointer[[]*Calendar] // replaced, never written
}

// refOf returns the ref of c (0 for nil).
func refOf(c *Calendar) calendarRef {
	if c == nil {
		return 0
	}
	if r := findCalendar(calendars.all.Load(), c); r != 0 {
		return r
	}
	calendars.mu.Lock()
	defer calendars.mu.Unlock()
	all := calendars.all.Load()
	if r := findCalendar(all, c); r != 0 {
		return r
	}
	var next []*Calendar
	if all != nil {
		next = slices.Clone(*all)
	}
	next = append(next, c)
	calendars.all.Store(&next)
	return calendarRef(len(next))
}

// findCalendar returns the ref of the calendar in all of c's unit and time
// zone, or 0.
func findCalendar(all *[]*Calendar, c *Calendar) calendarRef {
	if all == nil {
		return 0
	}
	for i, o := range *all {
		if o == c || o.Unit == c.Unit && o.Loc.String() == c.Loc.String() {
			return calendarRef(i + 1)
		}
	}
	return 0
}

// calendar returns the calendar r names, nil for 0.
func (r calendarRef) calendar() *Calendar {
	if r == 0 {
		return nil
	}
	return (*calendars.all.Load())[r-1]
}
