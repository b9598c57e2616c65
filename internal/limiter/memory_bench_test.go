package limiter

import (
	"fmt"
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// benchKeys returns n distinct IPv4-looking keys.
func benchKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255)
	}
	return keys
}

// BenchmarkMemoryStoreHit measures one decision for a key already tracked:
// the request path's cost in the store. It must report 0 allocs/op.
func BenchmarkMemoryStoreHit(b *testing.B) {
	for _, n := range []int{1, 100_000} {
		keys := benchKeys(n)
		lim := Limit{Window: time.Hour, Max: 1 << 30}
		newStore := func() *MemoryStore {
			s := NewMemoryStore(max(n, DefaultMaxTracked))
			for _, k := range keys {
				s.Hit(bg, k, t0, lim)
			}
			return s
		}
		b.Run(fmt.Sprintf("keys=%d/serial", n), func(b *testing.B) {
			s := newStore()
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				s.Hit(bg, keys[i%n], t0, lim)
			}
		})
		b.Run(fmt.Sprintf("keys=%d/parallel", n), func(b *testing.B) {
			s := newStore()
			var next atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(next.Add(7919)) // start goroutines at different keys
				for pb.Next() {
					s.Hit(bg, keys[i%n], t0, lim)
					i++
				}
			})
		})
	}
}

// BenchmarkMemoryStoreNewKeys measures inserting keys into a full store,
// where every insert evicts: the cost of a flood of new clients.
func BenchmarkMemoryStoreNewKeys(b *testing.B) {
	keys := benchKeys(1 << 20)
	lim := Limit{Window: time.Hour, Max: 10}
	s := NewMemoryStore(DefaultMaxTracked)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		s.Hit(bg, keys[i&(1<<20-1)], t0, lim)
	}
}

// BenchmarkMemoryStoreFootprint reports what a full store of IPv4 keys
// holds per key (custom metric bytes/key): its live heap plus the inline
// tables mapped outside the heap (which the collector adds no headroom to).
func BenchmarkMemoryStoreFootprint(b *testing.B) {
	for _, n := range []int{100_000, 1_000_000} {
		b.Run(fmt.Sprintf("keys=%d", n), func(b *testing.B) {
			keys := benchKeys(n)
			lim := Limit{Window: time.Hour, Max: 10}
			var perKey, heap float64
			for b.Loop() {
				var before, after runtime.MemStats
				runtime.GC()
				runtime.ReadMemStats(&before)
				s := NewMemoryStore(len(keys))
				for _, k := range keys {
					s.Hit(bg, k, t0, lim)
				}
				runtime.GC()
				runtime.ReadMemStats(&after)
				heap = float64(after.HeapAlloc) - float64(before.HeapAlloc)
				perKey = (heap + float64(inlineBytes(s))) / float64(len(keys))
				runtime.KeepAlive(s)
			}
			b.ReportMetric(perKey, "bytes/key")
			b.ReportMetric(heap/float64(len(keys)), "heap-bytes/key")
		})
	}
}
