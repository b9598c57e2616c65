package limiter

import (
	"context"
	"math/rand/v2"
	"time"
)

// purge deletes every expired window of the shard and returns how many it
// deleted. The caller holds sh.mu.
func (sh *memShard) purge(t int64) int {
	n := 0
	for _, m := range sh.entries {
		for k, e := range m {
			if t >= e.expires() {
				delete(m, k)
				n++
			}
		}
	}
	if n > 0 {
		sh.compact()
	}
	for i := range sh.short.slots {
		if sl := &sh.short.slots[i]; sl.key.live() && t >= sl.entry().expires() {
			sh.short.remove(i)
			n++
		}
	}
	sh.short.tidy()
	return n
}

// Sweep purges every window expired at now, one shard at a time, and returns
// how many keys it dropped.
func (s *MemoryStore) Sweep(now time.Time) int {
	t := now.UnixNano()
	total := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n := sh.purge(t)
		sh.purgeBans(s, t, false)
		sh.compact()
		s.publish(i)
		sh.mu.Unlock()
		s.tracked.Add(-int64(n))
		total += n
	}
	return total
}

// Run implements Store: it calls Sweep every interval(), give or take a tenth at random so
// that zones created together do not sweep together, and Trim whenever
// SetMaxTracked lowers the bound below the keys tracked, until ctx is done.
// interval is read before each wait, so a caller can change it while the
// sweeper runs; a non-positive interval stops the sweeper.
func (s *MemoryStore) Run(ctx context.Context, interval func() time.Duration) {
	for {
		interval := interval()
		if interval <= 0 {
			return
		}
		jitter := time.Duration(rand.Int64N(int64(interval)/5+1)) - interval/10
		if !s.sweepAfter(ctx, interval+jitter) {
			return
		}
	}
}

// sweepAfter waits d and sweeps, trimming the store whenever it is woken
// meanwhile (a trim does not put the sweep off). It reports false when ctx
// ended first.
func (s *MemoryStore) sweepAfter(ctx context.Context, d time.Duration) bool {
	timer := s.clock.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-s.trimWake:
			s.Trim(ctx, s.clock.Now())
		case now := <-timer.C():
			s.Sweep(now)
			return true
		}
	}
}
