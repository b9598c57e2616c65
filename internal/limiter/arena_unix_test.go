//go:build !race && (linux || darwin || freebsd || netbsd || openbsd || dragonfly)

package limiter

import (
	"fmt"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// When the kernel refuses a mapping (vm.max_map_count reached, out of
// memory), that table goes on the Go heap: the store counts, lists, sweeps
// and frees as with mapped tables, and never unmaps memory it did not map.
// Every mapping refused, and every other one. Built without -race only, as
// mapped tables are (.ci/run runs it so).
func TestArenaFallsBackToHeap(t *testing.T) {
	// Not parallel: it swaps mmap for the package.
	if a := newArena(1 << 16); !a.mapped() {
		t.Fatal("a 64 KiB mapping failed unforced: the mapped path is not what this test runs beside")
	} else {
		a.free()
	}
	realMmap, realMunmap := mmap, munmap
	t.Cleanup(func() { mmap, munmap = realMmap, realMunmap })
	for _, every := range []int{1, 2} {
		t.Run(fmt.Sprint("refused 1 in ", every), func(t *testing.T) {
			var calls, refused, unmapped, foreign int
			mapped := map[*byte]bool{}
			mmap = func(fd int, off int64, n, prot, flags int) ([]byte, error) {
				if calls++; calls%every == 0 {
					refused++
					return nil, syscall.ENOMEM
				}
				b, err := realMmap(fd, off, n, prot, flags)
				if err == nil {
					mapped[&b[0]] = true
				}
				return b, err
			}
			munmap = func(b []byte) error {
				unmapped++
				if !mapped[&b[0]] {
					foreign++
					return nil
				}
				delete(mapped, &b[0])
				return realMunmap(b)
			}
			s := NewMemoryStore(200_000)
			lim := Limit{Window: time.Second, Max: 5}
			key := func(i int) string { return fmt.Sprint("10.2.", i>>8, ".", i&255) }
			for i := range 50_000 {
				hit(t, s, key(i), t0, lim)
				if i%2 == 0 {
					hit(t, s, key(i), t0, lim)
				}
			}
			mappedNow := 0
			for i := range s.shards {
				if m := s.shards[i].short.mem; m != nil && m.mapped() {
					mappedNow++
				}
			}
			if refused == 0 || (every == 1 && mappedNow != 0) || (every == 2 && mappedNow == 0) {
				t.Fatalf("%d of %d mappings refused, %d tables mapped now", refused, calls, mappedNow)
			}
			for _, i := range []int{0, 1, 25_000, 49_999} {
				want := 2 + i%2 // a third hit on the keys hit twice, a second else
				if v := hit(t, s, key(i), t0, lim); v.Remaining != want {
					t.Fatalf("%s: %+v, want %d remaining", key(i), v, want)
				}
			}
			listed := 0
			if err := s.Range(t.Context(), t0, func(KeyState) bool { listed++; return true }); err != nil || listed != 50_000 {
				t.Fatalf("listed %d keys (%v), want 50000", listed, err)
			}
			if n := s.Sweep(t0.Add(time.Second)); n != 50_000 {
				t.Fatalf("Sweep dropped %d, want 50000", n)
			}
			if left := inlineBytes(s); left != 0 {
				t.Fatalf("%d bytes of tables left after sweeping every key", left)
			}
			if foreign != 0 || (every == 1 && unmapped != 0) || (every == 2 && unmapped == 0) {
				t.Fatalf("%d unmaps, %d of them of memory not mapped", unmapped, foreign)
			}
		})
	}
}

// An arena that becomes unreachable without being freed (a store dropped
// without Close) is unmapped by its cleanup, through the munmap it was
// mapped under.
func TestArenaUnmappedWhenUnreachable(t *testing.T) {
	// Not parallel: it swaps munmap for the package.
	realMunmap := munmap
	t.Cleanup(func() { munmap = realMunmap })
	unmapped := make(chan int, 1)
	munmap = func(b []byte) error {
		unmapped <- len(b)
		return realMunmap(b)
	}
	func() {
		if a := newArena(1 << 16); !a.mapped() {
			t.Fatal("a 64 KiB mapping failed unforced")
		}
	}()
	munmap = realMunmap // arenas mapped from here on are not this test's
	deadline := time.After(10 * time.Second)
	for {
		runtime.GC()
		select {
		case n := <-unmapped:
			if n < 1<<16 {
				t.Fatalf("unmapped %d bytes, want the arena's %d", n, 1<<16)
			}
			return
		case <-deadline:
			t.Fatal("an unreachable arena was not unmapped within 10s")
		case <-time.After(10 * time.Millisecond):
		}
	}
}
