package tests

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// Sync mode behind the balancers real fleets have, with real Caddy
// processes on one redis-server (max 100, sync 100ms), in share and in
// all: a client under its quota is admitted wherever the balancer sends
// it, and instances started mid-window stay within the join bound of
// docs/redis.md.

// hammerKey sends requests of key to url, pause apart, until stop is
// closed, and counts those admitted.
func hammerKey(t *testing.T, stop <-chan struct{}, url, key string, pause time.Duration, admitted *atomic.Int64) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		if st, _ := syncGet(t, url, "", key); st == http.StatusOK {
			admitted.Add(1)
		}
		time.Sleep(pause)
	}
}

// layoutCase is a client's path through the fleet: the instance of each
// of its requests, one every 250ms.
type layoutCase struct {
	name string
	at   func(i int) int
	n    int
}

// TestSyncBalancerLayouts sends one client, under its quota, through two
// instances as a balancer would: moved from one to the other after 8
// requests, round robin, and off an instance drained after a burst that
// made it lease much of the quota. Every request under quota is admitted,
// except, after the drain, within two intervals and a sync round trip.
func TestSyncBalancerLayouts(t *testing.T) {
	srv := redistest.Start(t)
	const maxN = 100
	site := ":$PORT {" +
		syncZone("/share", "e2e-lb-share", "60s", maxN, []string{srv.Addr}, "100ms share") +
		syncZone("/all", "e2e-lb-all", "60s", maxN, []string{srv.Addr}, "100ms all") + "\n}"
	bases := []string{startCaddyProcess(t, site), startCaddyProcess(t, site)}
	warmUp(t, bases, "/share", "/all")
	untilWindowLeft(60*time.Second, 15*time.Second)
	layouts := []layoutCase{
		{"moving client", func(i int) int { return min(i/8, 1) }, 36},
		{"round robin", func(i int) int { return i % 2 }, 36},
	}
	var wg sync.WaitGroup
	for _, spend := range []string{"share", "all"} {
		for _, l := range layouts {
			wg.Go(func() {
				key := fmt.Sprintf("%s-%s", l.name, spend)
				var codes []int
				for i := range l.n {
					st, _ := syncGet(t, bases[l.at(i)], "/"+spend, key)
					codes = append(codes, st)
					time.Sleep(250 * time.Millisecond)
				}
				refused := 0
				for _, c := range codes {
					if c != http.StatusOK {
						refused++
					}
				}
				t.Logf("%s, sync %s: %d of %d requests refused", l.name, spend, refused, l.n)
				if refused != 0 {
					t.Errorf("%s, sync %s: %d of %d requests refused under max %d: %v", l.name, spend, refused, l.n, maxN, codes)
				}
			})
		}
		wg.Go(func() {
			// A burst of 60 through the first instance, then the
			// client moves to the second: at most 2 intervals and a
			// round trip of refusals there.
			key := "drained-" + spend
			admitted := 0
			var mu sync.Mutex
			var burst sync.WaitGroup
			for range 6 {
				burst.Go(func() {
					for range 10 {
						if st, _ := syncGet(t, bases[0], "/"+spend, key); st == http.StatusOK {
							mu.Lock()
							admitted++
							mu.Unlock()
						}
					}
				})
			}
			burst.Wait()
			moved := time.Now()
			var lastRefused time.Duration
			refused := 0
			for range 20 {
				sent := time.Now()
				switch st, _ := syncGet(t, bases[1], "/"+spend, key); st {
				case http.StatusOK:
					admitted++
				default:
					refused++
					lastRefused = sent.Sub(moved)
				}
				time.Sleep(250 * time.Millisecond)
			}
			t.Logf("drained instance, sync %s: %d admitted in all, %d of 20 refused after the move (the last %s after it)", spend, admitted, refused, lastRefused)
			if admitted < maxN && lastRefused > 300*time.Millisecond {
				t.Errorf("drained instance, sync %s: refused %s after the move with %d admitted of max %d; want no refusal after 2 intervals and a round trip",
					spend, lastRefused, admitted, maxN)
			}
		})
	}
	wg.Wait()
}

// Caddy processes started +1s, +3s and +5s into a window, each hammering
// one key from its start with the first: within max + 3·⌈max/4⌉ (1.75 ×
// max) in share; all is printed beside it.
func TestSyncStaggeredStart(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	const maxN = 100
	site := ":$PORT {" +
		syncZone("/share", "e2e-join-share", "20s", maxN, []string{srv.Addr}, "100ms share") +
		syncZone("/all", "e2e-join-all", "20s", maxN, []string{srv.Addr}, "100ms all") + "\n}"
	first := startCaddyProcess(t, site)
	warmUp(t, []string{first}, "/share", "/all")
	untilWindowLeft(20*time.Second, 19*time.Second)
	start := time.Now()
	var admitted [2]atomic.Int64 // share, all
	stop := make(chan struct{})
	var wg sync.WaitGroup
	hammer := func(base string) {
		for s, spend := range []string{"share", "all"} {
			wg.Go(func() { hammerKey(t, stop, base+"/"+spend, "hammered", 2*time.Millisecond, &admitted[s]) })
		}
	}
	hammer(first)
	for _, at := range []time.Duration{time.Second, 3 * time.Second, 5 * time.Second} {
		time.Sleep(time.Until(start.Add(at)))
		hammer(startCaddyProcess(t, site))
	}
	time.Sleep(time.Until(start.Add(9 * time.Second)))
	close(stop)
	wg.Wait()
	elapsed := time.Since(start)
	share, all := admitted[0].Load(), admitted[1].Load()
	t.Logf("joins at +1s, +3s, +5s (%s in all): sync share admitted %d, sync all %d, of max %d (share's bound %d)", elapsed.Round(time.Millisecond), share, all, maxN, maxN*7/4)
	if share < maxN || share > maxN*7/4 {
		t.Errorf("sync share admitted %d: want from %d to %d", share, maxN, maxN*7/4)
	}
	if all < maxN || all > 4*maxN {
		t.Errorf("sync all admitted %d: want from %d to %d", all, maxN, 4*maxN)
	}
	// The last counts reach Redis at the instances' next syncs.
	if !eventuallyAcross(func() bool { return redisCount(t, rdb, "e2e-join-share", "hammered") == share }) {
		t.Errorf("Redis holds %d, the fleet admitted %d", redisCount(t, rdb, "e2e-join-share", "hammered"), share)
	}
}

// Redis restarted empty while two Caddy processes spend one key of max 100
// (window 20s): the instances report what they hold again and lease
// nothing new while they learn, so the window admits at most 1.25 × max.
func TestSyncRestartEmptyBound(t *testing.T) {
	srv := redistest.StartReal(t, "the test restarts the server empty")
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	const maxN = 100
	site := ":$PORT {" + syncZone("/", "e2e-sync-restart-bound", "20s", maxN, []string{srv.Addr}, "100ms") + "\n}"
	bases := []string{startCaddyProcess(t, site), startCaddyProcess(t, site)}
	warmUp(t, bases, "/")
	untilWindowLeft(20*time.Second, 8*time.Second)
	var admitted atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, base := range bases {
		wg.Go(func() { hammerKey(t, stop, base+"/", "restarted", 10*time.Millisecond, &admitted) })
	}
	time.Sleep(250 * time.Millisecond)
	before := admitted.Load()
	srv.Stop()
	srv.Restart()
	time.Sleep(2 * time.Second) // more than a lease's length of learning
	close(stop)
	wg.Wait()
	eventuallyAcross(func() bool { return redisCount(t, rdb, "e2e-sync-restart-bound", "restarted") == admitted.Load() })
	got := redisCount(t, rdb, "e2e-sync-restart-bound", "restarted")
	t.Logf("admitted %d before the restart, %d in the window of max %d; Redis holds %d", before, admitted.Load(), maxN, got)
	if a := admitted.Load(); before == 0 || before >= maxN || a < maxN || a > maxN*5/4 {
		t.Errorf("admitted %d (%d before the restart): want from %d to %d, with some but not all before", a, before, maxN, maxN*5/4)
	}
	if got != admitted.Load() {
		t.Errorf("Redis holds %d after the restart, the fleet admitted %d", got, admitted.Load())
	}
}
