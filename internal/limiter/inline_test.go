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

// Eviction is FIFO per shard whichever structure a key lives in: the first
// keys go, the last stay, and every listed key reads back as it was sent.
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
			if s.Len() > 1000 || s.Len() < 900 {
				t.Fatalf("Len = %d after %d keys, want about 1000", s.Len(), n)
			}
			if got := s.Evictions(); got != uint64(n-s.Len()) {
				t.Fatalf("Evictions = %d, want %d", got, n-s.Len())
			}
			live := map[string]int{}
			s.Range(bg, t0, func(ks KeyState) bool { live[ks.Key] = ks.Count; return true })
			if len(live) != s.Len() {
				t.Fatalf("Range saw %d keys, Len = %d", len(live), s.Len())
			}
			for i := range 100 {
				if _, ok := live[key(i)]; ok {
					t.Fatalf("%s, among the first inserted, survived", key(i))
				}
				j := n - 1 - i
				want := 1
				if j%3 == 0 {
					want = 2
				}
				if got, ok := live[key(j)]; !ok || got != want {
					t.Fatalf("%s, among the last inserted: listed %t with count %d, want count %d", key(j), ok, got, want)
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
