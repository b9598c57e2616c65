package limiter

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

var (
	bg = context.Background()
	t0 = time.Unix(1_800_000_000, 0)
)

// hit decides one request of key against lim alone (slot 0, name "") and
// fails the test on an error (the memory store has none).
func hit(t testing.TB, s Store, key string, now time.Time, lim Limit) Verdict {
	t.Helper()
	var out [1]Verdict
	err := s.Decide(bg, []Check{{Key: key, Limit: lim}}, now, out[:])
	v := out[0]
	if err != nil {
		t.Fatalf("Hit(%q): %v", key, err)
	}
	return v
}

func TestMemoryStoreWindow(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	lim := Limit{Window: time.Minute, Max: 3}
	reset := t0.Add(time.Minute)

	for i, want := range []int{2, 1, 0} {
		v := hit(t, s, "a", t0.Add(time.Duration(i)*time.Second), lim)
		if !v.Allowed || v.Remaining != want || !v.Reset.Equal(reset) || v.RetryAfter != 0 || v.Max != 3 {
			t.Fatalf("hit %d = %+v, want allowed, remaining %d, reset %v", i+1, v, want, reset)
		}
	}
	// Over the limit: refused, counted as refused once, the window not extended.
	for i := range 3 {
		now := t0.Add(30 * time.Second)
		v := hit(t, s, "a", now, lim)
		if v.Allowed || v.Remaining != 0 || !v.Reset.Equal(reset) || v.RetryAfter != 30*time.Second {
			t.Fatalf("refused hit %d = %+v, want refused, reset %v, retry after 30s", i+1, v, reset)
		}
		if v.FirstRefusal != (i == 0) {
			t.Fatalf("refused hit %d: FirstRefusal = %t", i+1, v.FirstRefusal)
		}
	}
	// Another key has its own window.
	if v := hit(t, s, "b", t0.Add(30*time.Second), lim); !v.Allowed || v.Remaining != 2 {
		t.Fatalf("other key = %+v, want allowed with 2 remaining", v)
	}
	// One nanosecond before the edge: still refused. At the edge: a new window.
	if v := hit(t, s, "a", reset.Add(-1), lim); v.Allowed || v.RetryAfter != 1 {
		t.Fatalf("just before reset = %+v, want refused with 1ns to wait", v)
	}
	v := hit(t, s, "a", reset, lim)
	if !v.Allowed || v.Remaining != 2 || !v.Reset.Equal(reset.Add(time.Minute)) {
		t.Fatalf("at reset = %+v, want a fresh window ending %v", v, reset.Add(time.Minute))
	}
	if s.Len() != 2 {
		t.Fatalf("Len = %d, want 2 (reset in place, no new entry)", s.Len())
	}
}

// A lower max applied by a reload leaves remaining at zero, never negative; a
// higher one admits more at once.
func TestMemoryStoreLimitChange(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	for range 4 {
		hit(t, s, "k", t0, Limit{Window: time.Minute, Max: 5})
	}
	if v := hit(t, s, "k", t0, Limit{Window: time.Minute, Max: 2}); v.Allowed || v.Remaining != 0 || v.Max != 2 {
		t.Fatalf("after lowering max = %+v, want refused with 0 remaining", v)
	}
	if v := hit(t, s, "k", t0, Limit{Window: time.Minute, Max: 10}); !v.Allowed || v.Remaining != 5 {
		t.Fatalf("after raising max = %+v, want allowed with 5 remaining", v)
	}
}

func TestMemoryStoreFIFOEviction(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	lim := Limit{Window: time.Hour, Max: 10}
	// Fill well past the bound with live windows, one key per millisecond.
	n := 5000
	for i := range n {
		hit(t, s, fmt.Sprint("k", i), t0.Add(time.Duration(i)*time.Millisecond), lim)
	}
	if s.Len() != 1000 {
		t.Fatalf("Len = %d after %d keys, want 1000", s.Len(), n)
	}
	if got := s.Evictions(); got != uint64(n-s.Len()) {
		t.Fatalf("Evictions = %d, want %d", got, n-s.Len())
	}
	// FIFO across the store: the 1000 newest keys survive, whichever
	// shards they hash to, and every older one is gone.
	live := map[string]bool{}
	s.Range(bg, t0, func(ks KeyState) bool { live[ks.Key] = true; return true })
	if len(live) != s.Len() {
		t.Fatalf("Range saw %d keys, Len = %d", len(live), s.Len())
	}
	for i := range n {
		if want := i >= n-1000; live[fmt.Sprint("k", i)] != want {
			t.Fatalf("k%d of %d: listed %t, want %t", i, n, !want, want)
		}
	}
}

// At the bound, expired windows are purged before any live key is evicted.
func TestMemoryStorePurgeBeforeEvict(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	capacity := s.MaxTracked()
	short := Limit{Window: time.Second, Max: 10}
	long := Limit{Window: time.Hour, Max: 10}
	// Three quarters full: two thirds of it windows that will expire. Then
	// half the bound again of new keys, which overfills every shard unless
	// the expired windows make room.
	for i := range capacity * 3 / 4 {
		lim := long
		if i < capacity/2 {
			lim = short
		}
		hit(t, s, fmt.Sprint("k", i), t0, lim)
	}
	later := t0.Add(2 * time.Second)
	for i := range capacity / 2 {
		hit(t, s, fmt.Sprint("new", i), later, long)
	}
	if s.Evictions() != 0 {
		t.Fatalf("Evictions = %d, want 0: expired windows should have made room", s.Evictions())
	}
	n := 0
	s.Range(bg, later, func(ks KeyState) bool { n++; return true })
	if want := capacity/2 + capacity/4; n != want {
		t.Fatalf("live keys = %d, want %d", n, want)
	}
}

func TestMemoryStoreSweepAndForget(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	for i := range 10 {
		hit(t, s, fmt.Sprint("short", i), t0, Limit{Window: time.Second, Max: 1})
		hit(t, s, fmt.Sprint("long", i), t0, Limit{Window: time.Hour, Max: 1})
	}
	if got := s.Sweep(t0.Add(500 * time.Millisecond)); got != 0 {
		t.Fatalf("Sweep before expiry dropped %d", got)
	}
	if got := s.Sweep(t0.Add(time.Second)); got != 10 {
		t.Fatalf("Sweep dropped %d, want 10", got)
	}
	if s.Len() != 10 {
		t.Fatalf("Len = %d after sweep, want 10", s.Len())
	}
	hit(t, s, "long0", t0, Limit{Window: time.Hour, Max: 1}) // refused now
	if ok, _ := s.Forget(bg, "long0"); !ok {
		t.Fatal("Forget(long0) = false, want true")
	}
	if ok, _ := s.Forget(bg, "long0"); ok {
		t.Fatal("second Forget(long0) = true, want false")
	}
	if v := hit(t, s, "long0", t0, Limit{Window: time.Hour, Max: 1}); !v.Allowed {
		t.Fatalf("after Forget = %+v, want a fresh window", v)
	}
}

func TestMemoryStoreRangeReportsRefused(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	lim := Limit{Window: time.Minute, Max: 2}
	for range 5 {
		hit(t, s, "x", t0, lim)
	}
	var got []KeyState
	s.Range(bg, t0, func(ks KeyState) bool { got = append(got, ks); return true })
	if len(got) != 1 || got[0].Key != "x" || got[0].Count != 2 || got[0].Refused != 3 || !got[0].Reset.Equal(t0.Add(time.Minute)) {
		t.Fatalf("Range = %+v, want x with count 2, refused 3", got)
	}
	got = nil
	s.Range(bg, t0.Add(time.Minute), func(ks KeyState) bool { got = append(got, ks); return true })
	if len(got) != 0 {
		t.Fatalf("Range after expiry = %+v, want none", got)
	}
}

func TestMemoryStoreSweeperStops(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	hit(t, s, "gone", time.Now().Add(-time.Hour), Limit{Window: time.Second, Max: 1})
	ctx, cancel := context.WithCancel(bg)
	done := make(chan struct{})
	go func() { s.Run(ctx, func() time.Duration { return 10 * time.Millisecond }); close(done) }()
	deadline := time.Now().Add(5 * time.Second)
	for s.Len() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if s.Len() != 0 {
		t.Fatal("the sweeper did not purge an expired window")
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the sweeper did not stop when its context ended")
	}
}

// Many goroutines on a few keys: exactly max admitted per key.
func TestMemoryStoreConcurrentExact(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	lim := Limit{Window: time.Hour, Max: 100}
	var mu sync.Mutex
	admitted := map[string]int{}
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				key := fmt.Sprint("k", (g+i)%4)
				if v, _ := s.Hit(bg, key, t0, lim); v.Allowed {
					mu.Lock()
					admitted[key]++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	for k := range 4 {
		if got := admitted[fmt.Sprint("k", k)]; got != 100 {
			t.Errorf("k%d admitted %d, want exactly 100", k, got)
		}
	}
}

func ExampleMemoryStore() {
	s := NewMemoryStore(1000)
	lim := Limit{Window: time.Minute, Max: 2}
	now := time.Unix(1_800_000_000, 0)
	for range 3 {
		v, _ := s.Hit(context.Background(), "192.0.2.1", now, lim)
		fmt.Println(v.Allowed, v.Remaining, v.RetryAfter)
	}
	// Output:
	// true 1 0s
	// true 0 0s
	// false 0 1m0s
}

// A reload that shortens the window applies to a running window at once; a
// longer one applies from the next window.
func TestMemoryStoreWindowChange(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	hit(t, s, "k", t0, Limit{Window: time.Hour, Max: 1})
	v := hit(t, s, "k", t0.Add(time.Minute), Limit{Window: time.Minute, Max: 1})
	if v.Allowed || !v.Reset.Equal(t0.Add(2*time.Minute)) {
		t.Fatalf("after shortening = %+v, want refused until %v", v, t0.Add(2*time.Minute))
	}
	if v := hit(t, s, "k", t0.Add(2*time.Minute), Limit{Window: time.Minute, Max: 1}); !v.Allowed {
		t.Fatalf("at the shortened reset = %+v, want a fresh window", v)
	}
	v = hit(t, s, "k", t0.Add(150*time.Second), Limit{Window: time.Hour, Max: 5})
	if !v.Allowed || !v.Reset.Equal(t0.Add(3*time.Minute)) {
		t.Fatalf("after lengthening = %+v, want the running window kept until %v", v, t0.Add(3*time.Minute))
	}
}

// After a reload shortens the window (Limit.Since), a window begun under the
// longer one ends a new window after the reload at the latest, however often
// the key comes back in between: its requests never push the end further.
func TestMemoryStoreWindowShortenedSince(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	long := Limit{Window: 2 * time.Minute, Max: 2}
	for range 3 {
		hit(t, s, "k", t0, long)
	}
	short := Limit{Window: 5 * time.Second, Max: 2, Since: t0.Add(time.Second)}
	for _, at := range []time.Duration{2 * time.Second, 4 * time.Second, 5900 * time.Millisecond} {
		v := hit(t, s, "k", t0.Add(at), short)
		if v.Allowed || !v.Reset.Equal(t0.Add(6*time.Second)) {
			t.Fatalf("%s on: %+v, want refused until the reload plus 5s (%v)", at, v, t0.Add(6*time.Second))
		}
	}
	if v := hit(t, s, "k", t0.Add(6*time.Second), short); !v.Allowed || !v.Reset.Equal(t0.Add(11*time.Second)) {
		t.Fatalf("5s after the reload: %+v, want a fresh 5s window", v)
	}
	// A window begun after the reload is not cut short.
	if v := hit(t, s, "k", t0.Add(10*time.Second), short); !v.Allowed || !v.Reset.Equal(t0.Add(11*time.Second)) {
		t.Fatalf("in the new window: %+v, want it to end at %v", v, t0.Add(11*time.Second))
	}
}

// A reload that lowers max_tracked far below the keys tracked: a new key's
// request evicts insertEvictions keys itself, not the excess, so the store
// shrinks with each new key and never grows; the rest is evicted off the
// request path in slices of at most trimSlice keys, one shard's lock at a
// time, down to the bound, the oldest keys first.
func TestMemoryStoreLoweredBoundTrimmedInSlices(t *testing.T) {
	t.Parallel()
	for name, key := range keyForms {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			const n, bound, fresh = 20_000, 1000, 100
			s := NewMemoryStore(n)
			lim := Limit{Window: time.Hour, Max: 10}
			for i := range n {
				hit(t, s, key(i), t0, lim)
			}
			s.SetMaxTracked(bound)
			for i := n; i < n+fresh; i++ {
				size, evicted := s.Len(), s.Evictions()
				hit(t, s, key(i), t0, lim)
				if got := s.Evictions() - evicted; got != insertEvictions || s.Len() != size-1 {
					t.Fatalf("new key %d of %d tracked over a bound of %d: evicted %d, Len %d; want %d evicted, Len %d",
						i-n+1, size, bound, got, s.Len(), insertEvictions, size-1)
				}
			}

			// Half the excess one slice at a time, the rest by Trim.
			excess := s.Len() - bound
			for s.Len() > bound+excess/2 {
				size := s.Len()
				got := s.trimSome()
				if got < 1 || got > trimSlice || s.Len() != size-got {
					t.Fatalf("a slice at Len %d evicted %d, Len now %d; want 1 to %d evicted", size, got, s.Len(), trimSlice)
				}
			}
			size := s.Len()
			if got := s.Trim(bg, t0); got != size-bound || s.Len() != bound {
				t.Fatalf("Trim at Len %d evicted %d, Len now %d; want Len %d", size, got, s.Len(), bound)
			}
			if got := s.Trim(bg, t0); got != 0 {
				t.Fatalf("Trim within the bound evicted %d", got)
			}
			if got, want := s.Evictions(), uint64(n+fresh-bound); got != want {
				t.Fatalf("Evictions = %d, want %d", got, want)
			}

			live := map[string]bool{}
			s.Range(bg, t0, func(ks KeyState) bool { live[ks.Key] = true; return true })
			if len(live) != bound {
				t.Fatalf("Range lists %d keys, want %d", len(live), bound)
			}
			for i := n; i < n+fresh; i++ {
				if !live[key(i)] {
					t.Fatalf("%s, among the keys tracked last, was evicted", key(i))
				}
			}
			for i := range n / 2 {
				if live[key(i)] {
					t.Fatalf("%s, in the first half of the keys tracked, survived", key(i))
				}
			}
			// With the keys gone, the tables give their room back: at most
			// four times the bytes of a slot per key left.
			if got := inlineBytes(s); got > 4*bound*64 {
				t.Fatalf("%d bytes of inline tables for %d keys", got, bound)
			}
		})
	}
}

// The sweeper reaches a lowered bound without waiting for its interval, and
// stops with its context.
func TestMemoryStoreSweeperTrimsLoweredBound(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(5000)
	for i := range 5000 {
		hit(t, s, fmt.Sprint("k", i), time.Now(), Limit{Window: time.Hour, Max: 1})
	}
	ctx, cancel := context.WithCancel(bg)
	done := make(chan struct{})
	go func() { s.Run(ctx, func() time.Duration { return time.Hour }); close(done) }()
	s.SetMaxTracked(1000)
	deadline := time.Now().Add(10 * time.Second)
	for s.Len() != 1000 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if s.Len() != 1000 || s.Evictions() != 4000 {
		t.Fatalf("after lowering the bound to 1000: Len %d, Evictions %d; want 1000 and 4000", s.Len(), s.Evictions())
	}
	cancel()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the sweeper did not stop when its context ended")
	}
}

// New keys arriving while the sweeper trims a lowered bound: the store
// never grows past what it held, and ends at the bound, give or take the
// keys inserted at the same instant.
func TestMemoryStoreTrimWhileInserting(t *testing.T) {
	t.Parallel()
	const n, bound, workers, each = 5000, 1000, 4, 250
	s := NewMemoryStore(n)
	lim := Limit{Window: time.Hour, Max: 1}
	for i := range n {
		hit(t, s, fmt.Sprint("old", i), time.Now(), lim)
	}
	ctx, cancel := context.WithCancel(bg)
	defer cancel()
	go s.Run(ctx, func() time.Duration { return time.Hour })
	s.SetMaxTracked(bound)
	var wg sync.WaitGroup
	var mu sync.Mutex
	largest := 0
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				s.Hit(bg, fmt.Sprint("new", w, ".", i), time.Now(), lim)
				mu.Lock()
				largest = max(largest, s.Len())
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if largest > n+workers {
		t.Fatalf("Len reached %d while trimming %d keys to %d", largest, n, bound)
	}
	deadline := time.Now().Add(10 * time.Second)
	for s.Len() > bound+workers && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if s.Len() > bound+workers {
		t.Fatalf("Len = %d after trimming, want at most %d", s.Len(), bound+workers)
	}
}
