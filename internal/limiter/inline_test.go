package limiter

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
)

// keyForms are the shapes of key the memory store keeps: inline (at most
// inlineMax bytes), in a map (longer), and both in one store.
var keyForms = map[string]func(i int) string{
	"inline": func(i int) string { return fmt.Sprint("10.0.", i>>8, ".", i&255) },
	"map":    func(i int) string { return fmt.Sprint("key:a-long-client-name-", i) },
	"mixed": func(i int) string {
		if i%2 == 0 {
			return fmt.Sprint("k", i)
		}
		return fmt.Sprint("key:a-long-client-name-", i)
	},
}

// Eviction is FIFO across the store whichever structure a key lives in:
// exactly the last max_tracked keys stay, however the shards share them,
// and every listed key reads back as it was sent.
func TestMemoryStoreKeyFormsFIFO(t *testing.T) {
	t.Parallel()
	for name, key := range keyForms {
		t.Run(name, func(t *testing.T) {
			s := NewMemoryStore(1000)
			lim := Limit{Window: time.Hour, Max: 10}
			n := 5000
			for i := range n {
				now := t0.Add(time.Duration(i) * time.Millisecond)
				hit(t, s, key(i), now, lim)
				if i%3 == 0 {
					hit(t, s, key(i), now, lim) // a second count, read back below
				}
			}
			if s.Len() != 1000 {
				t.Fatalf("Len = %d after %d keys, want 1000", s.Len(), n)
			}
			if got := s.Evictions(); got != uint64(n-s.Len()) {
				t.Fatalf("Evictions = %d, want %d", got, n-s.Len())
			}
			live := map[string]int{}
			s.Range(bg, t0, func(ks KeyState) bool { live[ks.Key] = ks.Count; return true })
			if len(live) != s.Len() {
				t.Fatalf("Range saw %d keys, Len = %d", len(live), s.Len())
			}
			for i := range n - 1000 {
				if _, ok := live[key(i)]; ok {
					t.Fatalf("%s, inserted %d keys before the last, survived", key(i), n-1-i)
				}
			}
			for j := n - 1000; j < n; j++ {
				want := 1
				if j%3 == 0 {
					want = 2
				}
				if got, ok := live[key(j)]; !ok || got != want {
					t.Fatalf("%s, among the last 1000 inserted: listed %t with count %d, want count %d", key(j), ok, got, want)
				}
			}
		})
	}
}

// Keys at the inline bound, with bytes a client may send (NUL, 0xff, the
// bytes of another slot's header), keep separate counts in each slot.
func TestMemoryStoreInlineBoundKeys(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	keys := []string{
		"", "\x00", "\x00\x00", "a", "a\x00", "\xff", "\x80a", "\x81",
		strings.Repeat("x", inlineMax-1), strings.Repeat("x", inlineMax), strings.Repeat("x", inlineMax+1),
		"255.255.255.255", "255.255.255.2550",
	}
	lim := Limit{Window: time.Hour, Max: 100}
	for i, k := range keys {
		for slot := range 3 {
			c := Check{Key: k, Slot: slot, Limit: lim}
			for range i + slot + 1 {
				decide(t, s, t0, c)
			}
		}
	}
	for i, k := range keys {
		for slot := range 3 {
			var out [1]Verdict
			if err := s.Decide(bg, []Check{{Key: k, Slot: slot, Limit: lim}}, t0, out[:]); err != nil {
				t.Fatal(err)
			}
			if want := 100 - (i + slot + 2); out[0].Remaining != want {
				t.Fatalf("key %q slot %d: remaining %d, want %d", k, slot, out[0].Remaining, want)
			}
		}
	}
	if want := 3 * len(keys); s.Len() != want {
		t.Fatalf("Len = %d, want %d", s.Len(), want)
	}
}

// The inline table against a map, through random inserts, lookups, deletes
// and rebuilds: every live key is found with its window, no deleted one is,
// and the insertion ring lists the live keys oldest first.
func TestInlineTableModel(t *testing.T) {
	t.Parallel()
	r := rand.New(rand.NewPCG(1, 2))
	var tb inlineTable
	defer tb.rehash(0)
	model := map[inlineKey]int{} // live keys: the step that inserted them
	hash := func(k inlineKey) uint32 {
		h := uint32(2166136261)
		for _, b := range k {
			h = (h ^ uint32(b)) * 16777619
		}
		return h
	}
	var seq uint32
	for step := range 200_000 {
		k, _ := packKey(r.IntN(MaxChecks), fmt.Sprint(r.IntN(3000)))
		i, ok := tb.find(hash(k), &k)
		if _, want := model[k]; ok != want {
			t.Fatalf("step %d: find(%q) = %t, model has it %t", step, k.String(), ok, want)
		}
		switch {
		case ok && r.IntN(3) == 0:
			tb.remove(i)
			delete(model, k)
		case ok:
			if got := tb.slots[i].reset; got != int64(model[k]) {
				t.Fatalf("step %d: %q reset %d, want %d", step, k.String(), got, model[k])
			}
		default:
			seq++
			e := memEntry{reset: int64(step)}
			tb.add(hash(k), &k, &e, seq)
			model[k] = step
		}
		if step%20_000 == 0 {
			tb.rehash(max(minInlineSz, tb.live*100/growLoad))
		}
		if tb.live != len(model) || tb.used*100 > len(tb.slots)*maxLoad {
			t.Fatalf("step %d: live %d used %d of %d slots, model %d", step, tb.live, tb.used, len(tb.slots), len(model))
		}
		if step%1000 == 0 {
			// used counts the slots not free (a short count would let a
			// probe run forever); oldest is the live key inserted first.
			notFree := 0
			for j := range tb.slots {
				if tb.slots[j].key[0] != inlineFree {
					notFree++
				}
			}
			first := -1
			for _, at := range model {
				if first < 0 || at < first {
					first = at
				}
			}
			at, _, ok := tb.oldest()
			if notFree != tb.used || ok != (first >= 0) || (ok && model[tb.slots[at].key] != first) {
				t.Fatalf("step %d: used %d, %d slots not free; oldest %t at step %d, want step %d", step, tb.used, notFree, ok, model[tb.slots[at].key], first)
			}
		}
	}
	// The ring lists the live keys in the order they were inserted.
	var got []int
	for _, it := range tb.ring[tb.head:tb.tail] {
		if tb.holds(it) {
			got = append(got, model[tb.slots[it.at].key])
		}
	}
	if len(got) != len(model) || !slices.IsSorted(got) {
		t.Fatalf("ring lists %d live keys (model %d), in insertion order: %t", len(got), len(model), slices.IsSorted(got))
	}
}

// The two homes of a key, the inline table and the Go maps, behave alike:
// the same random decisions (one limit or two; fixed, sliding, GCRA,
// banning, costly), refunds, forgets, sweeps, cut windows and cleared
// slots, over short keys in one store and the same keys made long in
// another, give the same verdicts and listings.
func TestMemoryStoreShortAndLongKeysAlike(t *testing.T) {
	t.Parallel()
	const pad = "a-long-key-of-more-than-15-bytes:"
	short, long := NewMemoryStore(1000), NewMemoryStore(1000)
	limits := []Limit{
		{Window: 10 * time.Second, Max: 3},
		{Window: 10 * time.Second, Max: 4, Algorithm: SlidingWindow},
		{Window: 10 * time.Second, Max: 5, Algorithm: GCRA, Burst: 2},
		{Window: 10 * time.Second, Max: 2, Ban: 30 * time.Second, BanMax: 2 * time.Minute},
	}
	r := rand.New(rand.NewPCG(3, 5))
	now := t0
	check := func(key string, slot int) Check {
		return Check{Key: key, Slot: slot, Limit: limits[slot], Cost: 1 + r.IntN(2)*r.IntN(2)}
	}
	list := func(s *MemoryStore, strip string) []string {
		var out []string
		s.Range(bg, now, func(ks KeyState) bool {
			ks.Key = strings.TrimPrefix(ks.Key, strip)
			out = append(out, fmt.Sprintf("%+v", ks))
			return true
		})
		slices.Sort(out)
		return out
	}
	for step := range 20_000 {
		now = now.Add(time.Duration(r.IntN(700)) * time.Millisecond)
		key := fmt.Sprint("k", r.IntN(40))
		switch op := r.IntN(100); {
		case op < 80:
			var cs [2]Check
			n := 1 + r.IntN(2)
			cs[0] = check(key, r.IntN(len(limits)))
			cs[1] = check(fmt.Sprint("k", r.IntN(40)), (cs[0].Slot+1+r.IntN(len(limits)-1))%len(limits))
			var vs, vl [2]Verdict
			ls := cs
			for i := range n {
				ls[i].Key = pad + cs[i].Key
			}
			if err := short.Decide(bg, cs[:n], now, vs[:n]); err != nil {
				t.Fatal(err)
			}
			if err := long.Decide(bg, ls[:n], now, vl[:n]); err != nil {
				t.Fatal(err)
			}
			if vs != vl {
				t.Fatalf("step %d, decide %+v:\n short %+v\n long  %+v", step, cs[:n], vs[:n], vl[:n])
			}
			if vs[0].Allowed && r.IntN(4) == 0 {
				short.Refund(bg, cs[:n], now, vs[:n])
				long.Refund(bg, ls[:n], now, vl[:n])
			}
		case op < 85:
			c := Check{Key: key, Slot: r.IntN(len(limits))}
			a, _ := short.ForgetCheck(bg, c)
			c.Key = pad + key
			if b, _ := long.ForgetCheck(bg, c); a != b {
				t.Fatalf("step %d: ForgetCheck(%q) = %t short, %t long", step, key, a, b)
			}
		case op < 92:
			if a, b := short.Sweep(now), long.Sweep(now); a != b {
				t.Fatalf("step %d: Sweep dropped %d short, %d long", step, a, b)
			}
		case op < 97:
			slot, at := r.IntN(len(limits)), now.Add(time.Duration(r.IntN(5000))*time.Millisecond)
			short.cutSlot(slot, at)
			long.cutSlot(slot, at)
		default:
			slot := r.IntN(len(limits))
			short.ClearSlot(slot)
			long.ClearSlot(slot)
		}
		if short.Len() != long.Len() {
			t.Fatalf("step %d: Len %d short, %d long", step, short.Len(), long.Len())
		}
		if step%500 == 0 {
			if a, b := list(short, ""), list(long, pad); !slices.Equal(a, b) {
				t.Fatalf("step %d: listings differ:\n short %v\n long  %v", step, a, b)
			}
		}
	}
}

// After a flood of short keys, the sweep that drops their ended windows
// gives the tables' memory back (a Go map never shrinks); keys that remain
// keep a table sized to them.
func TestMemoryStoreSweepReturnsMemory(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(200_000)
	for i := range 100_000 {
		hit(t, s, fmt.Sprint("10.1.", i>>8, ".", i&255), t0, Limit{Window: time.Second, Max: 5})
	}
	hit(t, s, "203.0.113.1", t0, Limit{Window: time.Hour, Max: 5})
	flood := inlineBytes(s)
	if flood < 100_000*48 {
		t.Fatalf("%d bytes mapped for 100,001 keys, want at least 48 per key", flood)
	}
	if n := s.Sweep(t0.Add(time.Second)); n != 100_000 {
		t.Fatalf("Sweep dropped %d, want 100000", n)
	}
	if left := inlineBytes(s); left > 64*1024 {
		t.Fatalf("%d bytes still mapped for 1 key after the sweep (%d during the flood)", left, flood)
	}
	if v := hit(t, s, "203.0.113.1", t0.Add(time.Second), Limit{Window: time.Hour, Max: 5}); v.Remaining != 3 {
		t.Fatalf("the key that remained: %+v, want 3 remaining", v)
	}
}

// inlineBytes returns the bytes of s's inline tables.
func inlineBytes(s *MemoryStore) int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		if sh.short.mem != nil {
			n += len(sh.short.mem.b)
		}
		sh.mu.Unlock()
	}
	return n
}
