package limiter

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// Sync mode's shares in the layouts real fleets have, on a simulated clock:
// the tests run each instance's rounds themselves, every interval of the
// clock they step, so that leases lapse and windows pass without a wait.
// Windows are a day long: the clock stays within one, and Redis (whose
// key expiries run on its own clock) sees the counts of that day.

// simInterval is the sync interval of a simulated fleet.
const simInterval = 100 * time.Millisecond

// simFleet is a fleet of n sync-mode stores whose rounds the test runs
// (sim.step), with its clock.
type simFleet struct {
	t      *testing.T
	stores []*SyncStore
	opts   RedisStoreOptions
	addr   string
	now    time.Time
	next   time.Time // the next round
}

// newSimFleet starts n instances on srv at the clock's start.
func newSimFleet(t *testing.T, srv *redistest.Server, n int, opts RedisStoreOptions) *simFleet {
	t.Helper()
	opts.Sync = simInterval
	if opts.Prefix == "" {
		opts.Prefix = "test:" + t.Name() + ":"
	}
	if opts.Timeout == 0 {
		opts.Timeout = testTimeout
	}
	// The simulated day starts at a window's start, within half a day of
	// Redis's clock, which expires the keys (see alignedClock).
	f := &simFleet{t: t, opts: opts, addr: srv.Addr, now: alignedClock(24 * time.Hour).Now()}
	f.next = f.now
	for range n {
		f.join()
	}
	return f
}

// join starts one more instance now: its first round (which its first
// decisions wait for) runs at once.
func (f *simFleet) join() *SyncStore {
	f.t.Helper()
	opts := f.opts
	client := redis.NewClient(&redis.Options{Addr: f.addr, MaxRetries: -1})
	f.t.Cleanup(func() { client.Close() })
	opts.Client = client
	s := NewSyncStore(opts)
	s.markUsed()
	s.syncRound(context.Background(), f.now)
	s.table.setReady()
	f.stores = append(f.stores, s)
	return s
}

// step moves the clock by d, running every instance's rounds that fall
// due on the way.
func (f *simFleet) step(d time.Duration) {
	end := f.now.Add(d)
	for !f.next.After(end) {
		f.now = f.next
		for _, s := range f.stores {
			s.table.next.Store(f.now.Add(simInterval).UnixNano())
			s.syncRound(context.Background(), f.now)
		}
		f.next = f.next.Add(simInterval)
	}
	f.now = end
}

// hit sends one request of key to instance i now.
func (f *simFleet) hit(i int, key string, limit Limit) bool {
	f.t.Helper()
	v, err := f.stores[i].Hit(context.Background(), key, f.now, limit)
	if err != nil {
		f.t.Fatal(err)
	}
	return v.Allowed
}

// A client under its quota is never refused, wherever the balancer sends
// it: moved from one instance to another, sent round robin, or moved off
// an instance that leased much of the quota and was drained. Exact mode
// and all admit every request of these; share must too.
func TestRedisSyncShareFollowsClients(t *testing.T) {
	srv := redistest.Start(t)
	limit := Limit{Window: 24 * time.Hour, Max: 100}
	for _, spend := range []string{SyncShare, SyncAll} {
		t.Run(spend, func(t *testing.T) {
			for _, l := range []struct {
				name      string
				instances int
				at        func(i int) int // the instance of request i
				n         int
			}{
				{"moving client", 2, func(i int) int { return min(i/8, 1) }, 36}, // 8 to the first, then the second
				{"round robin", 3, func(i int) int { return i % 3 }, 90},
			} {
				t.Run(l.name, func(t *testing.T) {
					f := newSimFleet(t, srv, l.instances, RedisStoreOptions{SyncSpend: spend})
					refused := 0
					for i := range l.n {
						if !f.hit(l.at(i), "client", limit) {
							refused++
						}
						f.step(250 * time.Millisecond)
					}
					if refused != 0 {
						t.Errorf("%d of %d requests refused, max %d: want every one admitted", refused, l.n, limit.Max)
					}
				})
			}
			t.Run("drained instance", func(t *testing.T) {
				f := newSimFleet(t, srv, 2, RedisStoreOptions{SyncSpend: spend})
				// A burst on the first instance, which then asks for a
				// large lease, and is drained right after its round.
				admitted := 0
				for range 60 {
					if f.hit(0, "drained", limit) {
						admitted++
					}
				}
				f.step(simInterval)
				refused := 0
				for range 30 {
					if f.hit(1, "drained", limit) {
						admitted++
					} else {
						refused++
					}
					f.step(250 * time.Millisecond)
				}
				if admitted > limit.Max || (refused > 0 && admitted < limit.Max) {
					t.Errorf("admitted %d with %d refused on the second instance; want nothing refused under max %d", admitted, refused, limit.Max)
				}
			})
		})
	}
}

// Instances joining mid-window, each hammering a key from its start, stay
// within the bound docs/redis.md gives for them: max and, per instance
// that joins, its spare share of a new key (half of max over the
// instances it sees). Three joining one that has spent the window's max:
// 100 + 25 + 17 + 13 of max 100, against 1.75 × max allowed.
func TestRedisSyncJoinBound(t *testing.T) {
	srv := redistest.Start(t)
	limit := Limit{Window: 24 * time.Hour, Max: 100}
	for _, tc := range []struct {
		name  string
		joins []time.Duration // from the window's first request
		bound int
	}{
		{"joining at +1s, +3s, +5s", []time.Duration{time.Second, 3 * time.Second, 5 * time.Second}, 175},
		{"two joining at +3s", []time.Duration{3 * time.Second, 3 * time.Second}, 150},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newSimFleet(t, srv, 1, RedisStoreOptions{})
			admitted := 0
			start := f.now
			joins := tc.joins
			for f.now.Sub(start) < 8*time.Second {
				for len(joins) > 0 && f.now.Sub(start) >= joins[0] {
					f.join()
					joins = joins[1:]
				}
				for i := range f.stores {
					for range 5 {
						if f.hit(i, "hammered", limit) {
							admitted++
						}
					}
				}
				f.step(10 * time.Millisecond)
			}
			f.step(2 * simInterval)
			t.Logf("%s: admitted %d of max %d; Redis holds %d", tc.name, admitted, limit.Max, count(t, f.stores[0], "hammered"))
			if admitted < limit.Max || admitted > tc.bound {
				t.Errorf("admitted %d, want from %d to %d", admitted, limit.Max, tc.bound)
			}
			if got := count(t, f.stores[0], "hammered"); got != int64(admitted) {
				t.Errorf("Redis holds %d, the fleet admitted %d", got, admitted)
			}
		})
	}
}

// A Redis that restarts empty mid-window loses the counts and leases of
// the window: the instances report what they hold again, and lease no
// more than they did for a lease's length (learning), so the fleet admits
// at most 1.25 × max in that window.
func TestRedisSyncRestartEmptyBound(t *testing.T) {
	srv := redistest.StartReal(t, "the test restarts the server empty")
	limit := Limit{Window: 24 * time.Hour, Max: 100}
	for _, after := range []time.Duration{50 * time.Millisecond, 150 * time.Millisecond, 300 * time.Millisecond} {
		t.Run(fmt.Sprintf("after %s", after), func(t *testing.T) {
			f := newSimFleet(t, srv, 2, RedisStoreOptions{})
			admitted := 0
			hammer := func(d time.Duration) {
				for end := f.now.Add(d); f.now.Before(end); f.step(10 * time.Millisecond) {
					for i := range f.stores {
						for range 2 {
							if f.hit(i, "restarted", limit) {
								admitted++
							}
						}
					}
				}
			}
			hammer(after)
			before := admitted
			srv.Stop()
			srv.Restart()
			hammer(3 * time.Second)
			f.step(2 * simInterval)
			got := count(t, f.stores[0], "restarted")
			t.Logf("admitted %d before the restart, %d in all of max %d; Redis holds %d", before, admitted, limit.Max, got)
			if before == 0 || admitted < limit.Max || admitted > limit.Max*5/4 {
				t.Errorf("admitted %d (%d before the restart), want from %d to %d", admitted, before, limit.Max, limit.Max*5/4)
			}
			if got != int64(admitted) {
				t.Errorf("Redis holds %d after the restart, the fleet admitted %d", got, admitted)
			}
		})
	}
}
