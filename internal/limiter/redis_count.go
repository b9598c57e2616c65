package limiter

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"go.uber.org/zap"
)

// KeyCount is a count of a RedisStore's keys in Redis, as CountKeys returns
// it.
type KeyCount struct {
	// N is the number of keys counted, as Range lists them: every
	// instance's keys in the zone's limits.
	N int
	// At is when the count finished; for a partial count, when it was read.
	At time.Time
	// Partial is true when no count has finished yet: N is the most keys a
	// count so far has found, a lower bound.
	Partial bool
}

// Pacing of the counts of a store's keys.
const (
	// countEvery is the least time between the starts of two counts.
	countEvery = time.Second
	// countShare is how many times a count's duration passes before the
	// next starts: counting occupies Redis a tenth of the time at most,
	// however many readers ask.
	countShare = 10
	// countBudget bounds one count: past it the count stops, and what it
	// found is partial.
	countBudget = time.Minute
)

// keyCounter runs the counts of a store's keys, one at a time, and keeps
// the result, so that the readers (every open dashboard polls the zone list)
// share one SCAN of the keyspace instead of each starting its own. Its zero
// value is not ready: init makes ask.
type keyCounter struct {
	mu      sync.Mutex
	last    KeyCount      // the last count that finished; At is zero until one has
	best    int           // the most keys a count cut short found, while none has finished
	next    time.Time     // no count starts before then
	running chan struct{} // closed when the count under way ends; nil when none is
	failing bool          // the last count failed: its error is logged once per streak
	seen    atomic.Int64  // keys the count under way has found so far
	ask     chan struct{} // a count wanted, for Run to start
	clock   clock.Clock
}

func (c *keyCounter) init(clk clock.Clock) { c.ask, c.clock = make(chan struct{}, 1), clk }

// result is what a reader gets: the last finished count, or a partial one.
// The caller holds c.mu.
func (c *keyCounter) result() KeyCount {
	if !c.last.At.IsZero() {
		return c.last
	}
	n := c.best
	if c.running != nil {
		n = max(n, int(c.seen.Load()))
	}
	return KeyCount{N: n, At: c.clock.Now(), Partial: true}
}

// CountKeys returns the number of the zone's keys in Redis, the keys Range
// lists. Counting them walks the keyspace (Range), which takes seconds for
// hundreds of thousands of keys, so counts run in the background (Run starts
// them), one at a time, and every reader shares the one under way and its
// result. A count is reused until ten times what it took has passed (a
// second at least); a reader that comes later starts a new one and waits
// for it until ctx is done. A reader that cannot wait gets the last count
// that finished, with its time, and while none has finished a partial count:
// what the counts have found so far, marked Partial, never a false 0 of
// keys that were not counted yet.
func (s *redisCore) CountKeys(ctx context.Context) KeyCount {
	c := &s.counts
	c.mu.Lock()
	if c.running == nil && c.clock.Now().Before(c.next) {
		defer c.mu.Unlock()
		return c.result()
	}
	if c.running == nil {
		c.running = make(chan struct{})
		c.seen.Store(0)
		select {
		case c.ask <- struct{}{}:
		default:
		}
	}
	running := c.running
	c.mu.Unlock()
	select {
	case <-running:
	case <-ctx.Done():
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.result()
}

// count counts the zone's keys in Redis for CountKeys, within countBudget,
// and records the result.
func (s *redisCore) count(ctx context.Context) {
	c := &s.counts
	start := s.clock.Now()
	cctx, cancel := context.WithTimeout(ctx, countBudget)
	err := s.owner.Range(cctx, start, func(KeyState) bool { c.seen.Add(1); return true })
	cancel()
	end := s.clock.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	n := int(c.seen.Load())
	switch {
	case err == nil:
		c.last = KeyCount{N: n, At: end}
		c.failing = false
	default:
		c.best = max(c.best, n)
		if !c.failing && ctx.Err() == nil {
			// Once per streak: a count that always fails (a Redis user
			// without SCAN) would otherwise log at every count.
			s.logger.Warn("counting the zone's keys in redis: the zone list shows the last count that finished, or a partial one",
				zap.String("prefix", s.prefix), zap.Int("counted", n), zap.Error(err))
			c.failing = true
		}
	}
	c.next = start.Add(max(countEvery, countShare*end.Sub(start)))
	close(c.running)
	c.running = nil
}
