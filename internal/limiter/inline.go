package limiter

import (
	"runtime"
	"unsafe"
)

// A short key (an IPv4 address, an IPv6 one in short form, a short custom
// key) is kept inline, in an open-addressing table of fixed 48-byte slots
// outside the garbage-collected heap: no string header, no string bytes, no
// map overhead, and no headroom the collector would add on top of a heap of
// that size. Longer keys stay in the shard's Go maps. One table per shard
// holds the short keys of every limit slot.

// inlineMax is the longest key kept inline, in bytes: the longest IPv4
// address ("255.255.255.255") fits.
const inlineMax = 15

// inlineKey is a short key and its limit slot: byte 0 is 0 for a free slot,
// 1 for a deleted one, and inlineLive | slot<<4 | len for a live one; the
// key's bytes follow, the rest is zero.
type inlineKey [inlineMax + 1]byte

const (
	inlineFree    = 0
	inlineDeleted = 1
	inlineLive    = 0x80
)

// packKey returns key in slot as an inlineKey, or false for a key too long
// to be kept inline.
func packKey(slot int, key string) (k inlineKey, ok bool) {
	if len(key) > inlineMax {
		return k, false
	}
	k[0] = inlineLive | byte(slot)<<4 | byte(len(key))
	copy(k[1:], key)
	return k, true
}

// live reports whether the table slot holds a key.
func (k *inlineKey) live() bool { return k[0]&inlineLive != 0 }

// slot returns the limit slot of a live key.
func (k *inlineKey) slot() int { return int(k[0]>>4) & (1<<slotBits - 1) }

// String returns the key, without its slot.
func (k *inlineKey) String() string { return string(k.bytes()) }

// bytes returns the key's bytes, without its slot, in k.
func (k *inlineKey) bytes() []byte { return k[1 : 1+k[0]&0xf] }

// inlineSlot is one slot of an inline table: a key and its window, 48 bytes
// and no pointers.
type inlineSlot struct {
	key     inlineKey
	reset   int64
	count   int32
	refused int32
	prev    int32
	span    int32
	seq     uint32 // the low bits of the entry's insertion seq
	hash    uint32 // the key's hash, for rehashing
}

// entry returns the slot's window as a memEntry.
func (s *inlineSlot) entry() memEntry {
	return memEntry{reset: s.reset, seq: uint64(s.seq), count: s.count, refused: s.refused, prev: s.prev, span: s.span}
}

// set writes e's window (not its seq) into the slot.
func (s *inlineSlot) set(e *memEntry) {
	s.reset, s.count, s.refused, s.prev, s.span = e.reset, e.count, e.refused, e.prev, e.span
}

// ringItem records one inline insertion: the table slot and the seq the
// entry got; an item whose slot no longer holds that seq is stale.
type ringItem struct{ at, seq uint32 }

// inlineTable is one shard's table of short keys. Its slots and its
// insertion ring share one arena. The caller holds the shard's lock.
type inlineTable struct {
	slots      []inlineSlot
	ring       []ringItem // insertion order, oldest first: ring[head:tail]
	head, tail int
	live, used int // live keys; slots not free (live or deleted)
	mem        *arena
}

// maxLoad is the share of slots, in hundredths, that may be used before the
// table grows; it grows to hold its live keys at growLoad.
const (
	maxLoad     = 85
	growLoad    = 60
	minInlineSz = 16
)

// find returns where k is in the table, or false. h is the key's hash.
func (t *inlineTable) find(h uint32, k *inlineKey) (int, bool) {
	n := len(t.slots)
	if n == 0 {
		return 0, false
	}
	i := home(h, n)
	for {
		s := &t.slots[i]
		if s.key == *k {
			return i, true
		}
		if s.key[0] == inlineFree {
			return 0, false
		}
		if i++; i == n {
			i = 0
		}
	}
}

// home returns the first slot a hash probes in a table of n slots.
func home(h uint32, n int) int {
	return int(uint64(h) * uint64(n) >> 32)
}

// add inserts k, which is not in the table, with window e and insertion seq
// seq, growing the table when it is full.
func (t *inlineTable) add(h uint32, k *inlineKey, e *memEntry, seq uint32) {
	if (t.used+1)*100 > len(t.slots)*maxLoad {
		t.rehash(max(minInlineSz, (t.live+1)*100/growLoad))
	}
	i := t.free(h)
	s := &t.slots[i]
	if s.key[0] == inlineFree {
		t.used++
	}
	t.live++
	s.key = *k
	s.seq = seq
	s.hash = h
	s.set(e)
	if t.tail == len(t.ring) {
		t.compactRing()
	}
	t.ring[t.tail] = ringItem{at: uint32(i), seq: seq}
	t.tail++
}

// remove deletes the key at slot i. A deleted slot followed by a free one is
// freed, and so are the deleted slots before it, so that probes stay short.
func (t *inlineTable) remove(i int) {
	n := len(t.slots)
	t.live--
	if t.slots[(i+1)%n].key[0] != inlineFree {
		t.slots[i] = inlineSlot{key: inlineKey{inlineDeleted}}
		return
	}
	for {
		t.slots[i] = inlineSlot{}
		t.used--
		if i--; i < 0 {
			i = n - 1
		}
		if t.slots[i].key[0] != inlineDeleted {
			return
		}
	}
}

// holds reports whether the ring item still records a live entry.
func (t *inlineTable) holds(it ringItem) bool {
	s := &t.slots[it.at]
	return s.key.live() && s.seq == it.seq
}

// oldest returns the slot of the oldest live key, dropping the stale items
// before it, or false for an empty table.
func (t *inlineTable) oldest() (int, uint32, bool) {
	for t.head < t.tail {
		it := t.ring[t.head]
		if t.holds(it) {
			return int(it.at), it.seq, true
		}
		t.head++
	}
	t.head, t.tail = 0, 0
	return 0, 0, false
}

// compactRing moves the live items of the ring to its front, in order.
func (t *inlineTable) compactRing() {
	j := 0
	for _, it := range t.ring[t.head:t.tail] {
		if t.holds(it) {
			t.ring[j] = it
			j++
		}
	}
	t.head, t.tail = 0, j
}

// rehash moves the live keys to a new arena of n slots or more (no arena
// for n 0 and no live keys), keeping their insertion order.
func (t *inlineTable) rehash(n int) {
	old := *t
	*t = inlineTable{}
	if n > 0 || old.live > 0 {
		n = max(n, old.live*100/maxLoad+1)
		slotBytes := n * int(unsafe.Sizeof(inlineSlot{}))
		t.mem = newArena(slotBytes + n*int(unsafe.Sizeof(ringItem{})))
		base := unsafe.Pointer(unsafe.SliceData(t.mem.b))
		t.slots = unsafe.Slice((*inlineSlot)(base), n)
		t.ring = unsafe.Slice((*ringItem)(unsafe.Add(base, slotBytes)), n)
		for _, it := range old.ring[old.head:old.tail] {
			if !old.holds(it) {
				continue
			}
			i := t.free(old.slots[it.at].hash)
			t.slots[i] = old.slots[it.at]
			t.ring[t.tail] = ringItem{at: uint32(i), seq: it.seq}
			t.tail++
		}
		t.live, t.used = old.live, old.live
	}
	if old.mem != nil {
		old.mem.free()
	}
}

// tidy rebuilds the table when deleted slots lengthen its probes or it
// holds far more room than keys, and frees it when empty.
func (t *inlineTable) tidy() {
	if n := len(t.slots); n > 0 && (t.live == 0 || (t.used-t.live)*4 > n || (n > 4*minInlineSz && t.live*4 < n)) {
		size := 0
		if t.live > 0 {
			size = max(minInlineSz, t.live*100/growLoad)
		}
		t.rehash(size)
	}
}

// free returns the first slot not live on the probe path of hash h. The
// table has room.
func (t *inlineTable) free(h uint32) int {
	n := len(t.slots)
	i := home(h, n)
	for t.slots[i].key.live() {
		if i++; i == n {
			i = 0
		}
	}
	return i
}

// arena is memory mapped outside the Go heap where the platform allows
// (mapArena), so that the collector neither scans it nor counts it
// towards its next goal; it is unmapped when freed, or when it becomes
// unreachable. Each shard's table is one mapping (64 per store at most);
// when the kernel refuses one (vm.max_map_count), the table goes on the
// heap instead.
type arena struct {
	mapping
	cleanup runtime.Cleanup
}

// mapping is memory and the function that unmaps it, nil for memory on the
// Go heap. Apart from the arena, it is the arena's cleanup, which must not
// hold the arena: a method expression, not a closure over unmap, which would
// cost one allocation more per arena.
type mapping struct {
	b     []byte
	unmap func([]byte) error
}

// release unmaps the memory.
func (m mapping) release() { _ = m.unmap(m.b) }

// newArena returns a zeroed arena of at least size bytes.
func newArena(size int) *arena {
	a := &arena{mapping: mapArena(size)}
	if a.mapped() {
		a.cleanup = runtime.AddCleanup(a, mapping.release, a.mapping)
	}
	return a
}

// mapped reports whether the arena's memory is mapped outside the heap.
func (a *arena) mapped() bool { return a.unmap != nil }

// free releases the arena's memory now.
func (a *arena) free() {
	if a.mapped() {
		a.cleanup.Stop()
		a.release()
	}
	a.b = nil
}
