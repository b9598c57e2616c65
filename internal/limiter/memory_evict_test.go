package limiter

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// Inserts, forgets, sweeps and decisions over two limits from several
// goroutines at once: afterwards the store is within its bound, give or take
// the keys inserted at the same instant; every shard publishes the seq of
// the oldest key it holds (eviction goes by it); and eviction is FIFO: bound
// new keys, one after another, leave exactly those.
func TestMemoryStoreEvictionConcurrent(t *testing.T) {
	t.Parallel()
	const bound, workers, each = 1000, 4, 3000
	s := NewMemoryStore(bound)
	key := keyForms["mixed"]
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				k, now := key(w*each+i), t0.Add(time.Duration(i)*time.Millisecond)
				lim := Limit{Window: time.Hour, Max: 10}
				if i%5 == 0 {
					lim.Window = time.Millisecond // expired by the next sweep
				}
				switch i % 7 {
				case 3:
					s.Forget(bg, key(w*each+i-1))
				case 6:
					checks := []Check{{Key: k, Limit: lim}, {Slot: 1, Key: k, Limit: lim}}
					if err := s.Decide(bg, checks, now, make([]Verdict, 2)); err != nil {
						t.Error(err)
					}
					continue
				}
				hit(t, s, k, now, lim)
				if i%500 == 499 {
					s.Sweep(now)
				}
			}
		}()
	}
	wg.Wait()
	if s.Len() > bound+workers {
		t.Fatalf("Len = %d once quiet, want at most %d", s.Len(), bound+workers)
	}
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		held, published := sh.oldestSeq(s.seq.Load()), s.oldest[i].Load()
		sh.mu.Unlock()
		if published != held {
			t.Fatalf("shard %d publishes %d as its oldest seq, holds %d", i, published, held)
		}
	}

	later := t0.Add(time.Minute)
	for i := range bound {
		hit(t, s, fmt.Sprint("new", i), later, Limit{Window: time.Hour, Max: 10})
	}
	live := map[string]bool{}
	s.Range(bg, later, func(ks KeyState) bool { live[ks.Key+"/"+ks.Name] = true; return true })
	if s.Len() != bound || len(live) != bound {
		t.Fatalf("after %d new keys: Len %d, %d listed; want %d", bound, s.Len(), len(live), bound)
	}
	for i := range bound {
		if !live[fmt.Sprint("new", i)+"/"] {
			t.Fatalf("new%d, among the last %d keys inserted, was evicted", i, bound)
		}
	}
}
