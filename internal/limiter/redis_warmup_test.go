package limiter

import (
	"context"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// sleepCtx waits d, or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// The first decisions of a fresh zone are Redis's while its clients are
// slow to make their first contact, slower than a decision's timeout but
// within StartupWait: a Cluster topology that takes 300ms to load, or
// connections that take 300ms to open. Two instances, each with its own
// client, admit exactly max of a burst between them, and none is decided
// as on_error says (a degraded_allowed, which would admit more).
func TestRedisStoreFirstDecisionsWaitForRedis(t *testing.T) {
	srv := redistest.Start(t)
	const slow = 300 * time.Millisecond
	for _, tc := range []struct {
		name      string
		newClient func() redis.UniversalClient
	}{
		{"cluster topology", func() redis.UniversalClient {
			// A Cluster client over one plain server, whose topology
			// (CLUSTER SLOTS) takes slow to learn.
			return redis.NewClusterClient(&redis.ClusterOptions{
				ClusterSlots: func(ctx context.Context) ([]redis.ClusterSlot, error) {
					if err := sleepCtx(ctx, slow); err != nil {
						return nil, err
					}
					return []redis.ClusterSlot{{Start: 0, End: 16383, Nodes: []redis.ClusterNode{{Addr: srv.Addr}}}}, nil
				},
				ContextTimeoutEnabled: true,
				MaxRetries:            -1,
			})
		}},
		{"first dials", func() redis.UniversalClient {
			// Every connection opened within slow of the first opens
			// only then.
			var mu sync.Mutex
			var ready time.Time
			return redis.NewClient(&redis.Options{
				Addr: srv.Addr,
				Dialer: func(ctx context.Context, network, addr string) (net.Conn, error) {
					mu.Lock()
					if ready.IsZero() {
						ready = time.Now().Add(slow)
					}
					wait := time.Until(ready)
					mu.Unlock()
					if err := sleepCtx(ctx, wait); err != nil {
						return nil, err
					}
					return (&net.Dialer{}).DialContext(ctx, network, addr)
				},
				ContextTimeoutEnabled: true,
				MaxRetries:            -1,
			})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const instances, perInstance, maxN = 2, 15, 10
			var stores []*RedisStore
			for range instances {
				client := tc.newClient()
				t.Cleanup(func() { client.Close() })
				s := NewRedisStore(RedisStoreOptions{Client: client, Prefix: "first:" + t.Name() + ":"})
				ctx, cancel := context.WithCancel(context.Background())
				t.Cleanup(cancel)
				go s.Run(ctx, func() time.Duration { return time.Minute })
				stores = append(stores, s)
			}
			lim := Limit{Window: time.Minute, Max: maxN}
			var admitted, degraded atomic.Int64
			var slowest atomic.Int64
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range instances * perInstance {
				wg.Go(func() {
					<-start
					began := time.Now()
					v, err := stores[i%instances].Hit(context.Background(), "203.0.113.5", time.Now(), lim)
					d := int64(time.Since(began))
					for old := slowest.Load(); d > old && !slowest.CompareAndSwap(old, d); old = slowest.Load() {
					}
					if err == nil && v.Allowed {
						admitted.Add(1)
					}
					if err != nil || v.StoreError {
						degraded.Add(1)
					}
				})
			}
			close(start)
			wg.Wait()
			if admitted.Load() != maxN || degraded.Load() != 0 {
				t.Errorf("first %d decisions of two instances: %d admitted, %d decided without redis; want exactly %d admitted, all decided by redis",
					instances*perInstance, admitted.Load(), degraded.Load(), maxN)
			}
			// Bounded all the same: the start-up wait, then the decision's
			// own timeout (with room for a loaded machine).
			if d := time.Duration(slowest.Load()); d > StartupWait+DefaultTimeout+time.Second {
				t.Errorf("the slowest first decision took %s, want at most %s and the %s timeout", d, StartupWait, DefaultTimeout)
			}
			for i, s := range stores {
				if h := s.Health(); h != HealthHealthy {
					t.Errorf("instance %d: health %s, want HEALTHY", i, h)
				}
			}
		})
	}
}
