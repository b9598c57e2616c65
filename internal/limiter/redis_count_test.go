package limiter

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// scanHook slows every SCAN the client sends by delay, as a large keyspace
// or a loaded Redis would, and counts the walks of the keyspace begun (the
// SCANs from cursor 0).
type scanHook struct {
	delay time.Duration
	walks atomic.Int64
}

func (h *scanHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *scanHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h *scanHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "scan" {
			if fmt.Sprint(cmd.Args()[1]) == "0" {
				h.walks.Add(1)
			}
			select {
			case <-time.After(h.delay):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return next(ctx, cmd)
	}
}

// addKeys writes n count keys of the store's first limit, as n clients'
// first requests would, in one pipeline.
func addKeys(t *testing.T, s *RedisStore, client redis.UniversalClient, from, n int) {
	t.Helper()
	pipe := client.Pipeline()
	for i := from; i < from+n; i++ {
		pipe.Set(context.Background(), s.base("", fmt.Sprintf("10.%d.%d.%d", i>>16, i>>8&255, i&255))+"c", 1, time.Minute)
	}
	if _, err := pipe.Exec(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// countWithin returns CountKeys as a reader that waits at most d sees it.
func countWithin(s *RedisStore, d time.Duration) KeyCount {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return s.CountKeys(ctx)
}

// stale makes the store's last count due for renewal, as time passing
// would.
func stale(s *RedisStore) {
	s.counts.mu.Lock()
	s.counts.next = time.Time{}
	s.counts.mu.Unlock()
}

// A count of a Redis zone's keys that cannot finish while its reader waits
// never reads as 0 keys: before any count has finished the reader gets a
// partial count, marked so; afterwards, the last count that finished, with
// its time, also when the new count fails.
func TestRedisStoreCountKeysNeverFalseZero(t *testing.T) {
	srv := redistest.StartReal(t, "the count is paced by SCAN pages, whose size miniredis does not honour")
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	hook := &scanHook{delay: 100 * time.Millisecond}
	client.AddHook(hook)
	addKeys(t, s, client, 0, 1200)

	// Its first page alone takes longer than this reader waits.
	c := countWithin(s, 20*time.Millisecond)
	if !c.Partial {
		t.Fatalf("a count that could not finish: %+v, want it marked partial", c)
	}
	// A reader that waits longer shares the count under way.
	c = countWithin(s, 10*time.Second)
	if c.N != 1200 || c.Partial {
		t.Fatalf("finished count: %+v, want 1200 keys, not partial", c)
	}
	if n := hook.walks.Load(); n != 1 {
		t.Errorf("%d walks of the keyspace for two readers of one count, want 1", n)
	}
	done := c.At

	// Due for renewal, with more keys: a reader that cannot wait for the
	// new count gets the last one, with its time.
	addKeys(t, s, client, 1200, 300)
	stale(s)
	c = countWithin(s, 20*time.Millisecond)
	if c.N != 1200 || c.Partial || !c.At.Equal(done) {
		t.Errorf("while a new count runs: %+v, want the last count (1200 keys at %s)", c, done.Format(time.StampMilli))
	}
	c = countWithin(s, 10*time.Second)
	if c.N != 1500 || c.Partial || !c.At.After(done) {
		t.Errorf("after the new count: %+v, want 1500 keys counted after %s", c, done.Format(time.StampMilli))
	}
	done = c.At

	// Redis gone: the count fails, and the last one stands.
	srv.Stop()
	stale(s)
	c = countWithin(s, 10*time.Second)
	if c.N != 1500 || c.Partial || !c.At.Equal(done) {
		t.Errorf("with redis gone: %+v, want the last count (1500 keys at %s)", c, done.Format(time.StampMilli))
	}
}

// Concurrent readers of a zone's key count share one walk of the keyspace,
// and readers soon after reuse its result.
func TestRedisStoreCountKeysShared(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	hook := &scanHook{delay: 20 * time.Millisecond}
	client.AddHook(hook)
	addKeys(t, s, client, 0, 700)
	const readers = 16
	for round := range 2 {
		var wg sync.WaitGroup
		start := make(chan struct{})
		for range readers {
			wg.Go(func() {
				<-start
				if c := countWithin(s, 10*time.Second); c.N != 700 || c.Partial {
					t.Errorf("round %d: a reader got %+v, want 700 keys, not partial", round, c)
				}
			})
		}
		close(start)
		wg.Wait()
		if n := hook.walks.Load(); n != 1 {
			t.Errorf("after round %d of %d concurrent readers: %d walks of the keyspace, want 1", round, readers, n)
		}
	}
}
