package limiter

import (
	"strconv"
	"strings"
	"testing"
	"time"
)

// An entry removed from a shard's slab leaves its references stale and
// its memory to the next key added, which none reads as its own; keys too
// long to be kept inline, and a limit's name, come back whole.
func TestSyncSlabReusesEntries(t *testing.T) {
	y := newSyncTable(time.Second, SyncShare, "id", 100, 0)
	sl := &syncSlab{}
	add := func(ck string) *syncEntry {
		_, h := y.hashOf(ck)
		return sl.add(h, ck)
	}
	find := func(ck string) *syncEntry {
		_, h := y.hashOf(ck)
		return sl.find(h, ck)
	}
	long := "lim\x00key:" + strings.Repeat("x", 2*syncKeyInline)
	a, b, c := add("10.0.0.1"), add(long), add("10.0.0.3")
	b.nameLen = 3
	a.mine = 5
	ra, rb := a.ref(), b.ref()
	if e, ok := sl.held(ra); e != a || !ok {
		t.Error("a reference does not name its entry")
	}
	if got := sl.key(b); got != long[4:] {
		t.Errorf("long key: %q, want %q", got, long[4:])
	}
	if got, _ := sl.parts(b); got != "lim" {
		t.Errorf("long key's limit: %q, want lim", got)
	}
	if find("10.0.0.1") != a || find(long) != b || find("10.0.0.3") != c || find("10.0.0.2") != nil {
		t.Fatal("find does not return the entries added")
	}

	sl.remove(a)
	sl.remove(b)
	for _, r := range []syncRef{ra, rb} {
		if _, ok := sl.held(r); ok {
			t.Error("a reference to a removed entry names it")
		}
	}
	if find("10.0.0.1") != nil || find(long) != nil {
		t.Error("a removed key is found")
	}
	if len(sl.long) != 0 {
		t.Errorf("the slab keeps %d long keys of removed entries", len(sl.long))
	}
	d := add("10.0.0.4")
	if d != a && d != b {
		t.Error("a new key did not take a removed entry's memory")
	}
	if d.mine != 0 {
		t.Errorf("the new key starts with the removed one's count %d", d.mine)
	}
	for _, r := range []syncRef{ra, rb} {
		if _, ok := sl.held(r); ok {
			t.Error("a stale reference reads the entry's new key as its own")
		}
	}
	if e, ok := sl.held(d.ref()); e != d || !ok {
		t.Error("a reference to the new key does not name it")
	}
	if find("10.0.0.4") != d || find("10.0.0.3") != c {
		t.Error("the entries in the table are not found after a reuse")
	}
	if sl.live != 2 {
		t.Errorf("the slab counts %d entries, want 2", sl.live)
	}
	// Keys either side of the inline length, and a name of 32 bytes (the
	// module's longest).
	name := strings.Repeat("n", 32)
	for _, n := range []int{syncKeyInline - 1, syncKeyInline, syncKeyInline + 1} {
		ck := strings.Repeat("k", n)
		named := name + "\x00" + ck
		e, f := add(ck), add(named)
		f.nameLen = uint8(len(name))
		if find(ck) != e || find(named) != f || find(ck+"k") != nil {
			t.Errorf("a key of %d bytes: not found, or found as another", n)
		}
		if got := sl.key(e); got != ck {
			t.Errorf("a key of %d bytes comes back as %q", n, got)
		}
		if lim, key := sl.parts(f); lim != name || key != ck {
			t.Errorf("a key of %d bytes in limit %q comes back as %q in %q", n, name, key, lim)
		}
	}
}

// The index grows with the keys and shrinks once most are gone; every key
// in the table is found throughout, the entries' memory stays put.
func TestSyncSlabIndexGrowsAndShrinks(t *testing.T) {
	y := newSyncTable(time.Second, SyncShare, "id", 100, 0)
	sl := &syncSlab{}
	const keys = 10_000
	es := make([]*syncEntry, keys)
	for i := range keys {
		ck := "k" + strconv.Itoa(i)
		_, h := y.hashOf(ck)
		es[i] = sl.add(h, ck)
		es[i].mine = int64(i)
	}
	grown := len(sl.index)
	for i := range keys {
		if i%10 != 0 {
			sl.remove(es[i])
		}
	}
	sl.tidy()
	if len(sl.index) >= grown/4 {
		t.Errorf("the index holds %d slots for %d keys (%d at %d keys)", len(sl.index), sl.live, grown, keys)
	}
	for i := range keys {
		ck := "k" + strconv.Itoa(i)
		_, h := y.hashOf(ck)
		e := sl.find(h, ck)
		switch {
		case i%10 == 0 && (e != es[i] || e.mine != int64(i)):
			t.Fatalf("key %s: found %p (count %d), want %p", ck, e, e.mine, es[i])
		case i%10 != 0 && e != nil:
			t.Fatalf("key %s: found after its removal", ck)
		}
	}
	n := 0
	sl.each(func(*syncEntry) bool { n++; return true })
	if n != keys/10 {
		t.Errorf("each visits %d entries, want %d", n, keys/10)
	}
}

// Calendars of one unit and time zone share a ref, whichever Location
// value names the zone.
func TestCalendarRefs(t *testing.T) {
	paris1, paris2 := time.FixedZone("Europe/Paris", 3600), time.FixedZone("Europe/Paris", 3600)
	day1, day2 := &Calendar{Unit: CalendarDay, Loc: paris1}, &Calendar{Unit: CalendarDay, Loc: paris2}
	month := &Calendar{Unit: CalendarMonth, Loc: paris1}
	if refOf(nil) != 0 || calendarRef(0).calendar() != nil {
		t.Error("no calendar is not ref 0")
	}
	r1, r2, r3 := refOf(day1), refOf(day2), refOf(month)
	if r1 == 0 || r1 != r2 {
		t.Errorf("two loads of one zone's day calendar: refs %d and %d", r1, r2)
	}
	if r3 == r1 {
		t.Error("a month calendar shares a day calendar's ref")
	}
	if c := r3.calendar(); c.Unit != CalendarMonth || c.Loc.String() != "Europe/Paris" {
		t.Errorf("ref %d names %v", r3, c)
	}
}
