package limiter

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// syncFleet returns n stores in sync mode sharing one zone on addrs, as n
// Caddy instances would.
func syncFleet(t *testing.T, addrs []string, n int, opts RedisStoreOptions) []*RedisStore {
	t.Helper()
	if opts.Prefix == "" {
		opts.Prefix = "test:" + t.Name() + ":"
	}
	fleet := make([]*RedisStore, n)
	for i := range fleet {
		fleet[i], _ = newTestRedisStore(t, addrs, opts)
		fleet[i].markUsed()
	}
	return fleet
}

// untilWindowStarts waits, when less than need is left of the window of
// length w in progress, for the next one: windows are aligned to the clock
// in sync mode.
func untilWindowStarts(w, need time.Duration) {
	left := w - time.Duration(time.Now().UnixNano()%int64(w))
	if left < need {
		time.Sleep(left + 5*time.Millisecond)
	}
}

// waitSynced waits until every store of the fleet has had a round that
// started after from.
func waitSynced(t *testing.T, fleet []*RedisStore, from time.Time) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, s := range fleet {
		for s.sync.lastOK.Load() <= from.UnixNano() {
			if time.Now().After(deadline) {
				t.Fatal("the fleet did not sync within 10s")
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// In sync mode decisions never wait for Redis, a fleet's admitted total
// stays within the bound, and once the instances have synced Redis holds
// exactly what they admitted: the same count on every instance's listing.
func TestRedisSyncFleetOneKey(t *testing.T) {
	srv := redistest.Start(t)
	for _, n := range []int{2, 4} {
		for _, spend := range []string{SyncAll, SyncShare} {
			t.Run(fmt.Sprintf("%d instances, %s", n, spend), func(t *testing.T) {
				fleet := syncFleet(t, []string{srv.Addr}, n, RedisStoreOptions{Sync: 100 * time.Millisecond, SyncSpend: spend})
				limit := Limit{Window: 10 * time.Second, Max: 100}
				untilWindowStarts(limit.Window, 2*time.Second)
				waitSynced(t, fleet, time.Now())
				waitSynced(t, fleet, time.Now())
				for i, s := range fleet {
					t.Logf("store %d sees fleet %d", i, s.sync.fleet.Load())
				}
				var admitted atomic.Int64
				var wg sync.WaitGroup
				stop := time.Now().Add(time.Second)
				for _, s := range fleet {
					for range 2 {
						wg.Go(func() {
							for time.Now().Before(stop) {
								v, err := s.Hit(context.Background(), "hammered", time.Now(), limit)
								if err != nil {
									t.Error(err)
									return
								}
								if v.Allowed {
									admitted.Add(1)
								}
								time.Sleep(time.Millisecond)
							}
						})
					}
				}
				wg.Wait()
				waitSynced(t, fleet, time.Now())
				got, err := fleet[0].client.Get(context.Background(), fleet[0].base("", "hammered")+"c").Int64()
				if err != nil {
					t.Fatal(err)
				}
				t.Logf("%d instances, spend %s: admitted %d of max %d; Redis holds %d", n, spend, admitted.Load(), limit.Max, got)
				if got != admitted.Load() {
					t.Errorf("Redis holds %d, the fleet admitted %d", got, admitted.Load())
				}
			})
		}
	}
}

var _ = strconv.Itoa
