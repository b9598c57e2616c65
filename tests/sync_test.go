package tests

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// syncZone is a site block of one rate_limit handler in sync mode at path,
// keyed by the X-Client header.
func syncZone(path, zone, window string, maxN int, addrs []string, sync string) string {
	return fmt.Sprintf(`
	handle %s {
		rate_limit {
			zone %s
			window %s
			max %d
			key {http.request.header.X-Client}
			store redis {
				address %s
				timeout 1s
				sync %s
			}
		}
		respond "ok"
	}`, path, zone, window, maxN, strings.Join(addrs, " "), sync)
}

// untilWindowLeft waits, when less than need is left of the window of
// length w in progress, for the next one: sync mode aligns windows to the
// clock.
func untilWindowLeft(w, need time.Duration) {
	if left := w - time.Duration(time.Now().UnixNano()%int64(w)); left < need {
		time.Sleep(left + 20*time.Millisecond)
	}
}

// syncGet sends one request for key to base+path and returns its status
// and the end of its window (the Reset header, Unix seconds).
func syncGet(t *testing.T, base, path, key string) (int, int64) {
	req, _ := http.NewRequest(http.MethodGet, base+path, nil)
	req.Header.Set("X-Client", key)
	resp, err := loadClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, 0
	}
	resp.Body.Close()
	reset, _ := strconv.ParseInt(resp.Header.Get("X-RateLimit-Reset"), 10, 64)
	return resp.StatusCode, reset
}

// warmUp sends one request to each path of each instance, which starts
// its syncs, and waits three intervals (of 100ms): then every instance
// knows the fleet. (An instance counts the fleet from its first sync: a
// fleet started at once spends, in its first interval, as if each
// instance were alone.)
func warmUp(t *testing.T, bases []string, paths ...string) {
	for _, base := range bases {
		for _, p := range paths {
			if st, _ := syncGet(t, base, p, "warm-up"); st != http.StatusOK && st != http.StatusTooManyRequests {
				t.Fatalf("warm-up: %d", st)
			}
		}
	}
	time.Sleep(400 * time.Millisecond)
}

// redisCount returns the fleet's count of key in zone, in the newest window
// Redis counts it, as Redis holds it.
func redisCount(t *testing.T, c redis.UniversalClient, zone, key string) int64 {
	t.Helper()
	field := "caddy_rate_limit:" + zone + ":{key:" + key + "}:g"
	newest, n := int64(0), int64(0)
	for end, fields := range syncWindows(t, c, zone, "*") {
		if v, ok := fields[field]; ok && end > newest {
			newest, n = end, v
		}
	}
	return n
}

// syncWindows returns what Redis holds of zone's sync mode counts: by the
// end of each window (Unix ms), each key's field and the fleet's count of
// it. A window's counts are hashes named <prefix>w:{<tag>}:<end>:<length>
// (one per Cluster slot on a Cluster), a field per key, each holding the
// instances' records: a 13-byte id, then count, leased and until as
// little-endian 64-bit integers. end selects the windows by their end, a
// glob: "*" for all.
func syncWindows(t *testing.T, c redis.UniversalClient, zone, end string) map[int64]map[string]int64 {
	t.Helper()
	ctx := context.Background()
	prefix := "caddy_rate_limit:" + zone + ":w:{"
	var mu sync.Mutex
	out := map[int64]map[string]int64{}
	read := func(ctx context.Context, c redis.UniversalClient) error {
		hashes, err := c.Keys(ctx, prefix+"*}:"+end+":*").Result()
		if err != nil {
			return err
		}
		for _, h := range hashes {
			_, rest, _ := strings.Cut(strings.TrimPrefix(h, prefix), "}:")
			endText, _, _ := strings.Cut(rest, ":")
			end, err := strconv.ParseInt(endText, 10, 64)
			if err != nil {
				return fmt.Errorf("window hash %q: %w", h, err)
			}
			fields, err := c.HGetAll(ctx, h).Result()
			if err != nil {
				return err
			}
			mu.Lock()
			if out[end] == nil {
				out[end] = map[string]int64{}
			}
			for f, v := range fields {
				out[end][f] += syncSum(t, v)
			}
			mu.Unlock()
		}
		return nil
	}
	var err error
	if cc, ok := c.(*redis.ClusterClient); ok {
		err = cc.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error { return read(ctx, m) })
	} else {
		err = read(ctx, c)
	}
	if err != nil {
		t.Fatalf("reading the sync counts: %v", err)
	}
	return out
}

// syncSum returns the sum of the instances' counts in a field of a window
// hash (syncWindows).
func syncSum(t *testing.T, v string) int64 {
	t.Helper()
	const size = 13 + 3*8
	if len(v)%size != 0 {
		t.Fatalf("a sync count of %d bytes, not records of %d", len(v), size)
	}
	var sum int64
	for p := 0; p < len(v); p += size {
		sum += int64(binary.LittleEndian.Uint64([]byte(v[p+13:])))
	}
	return sum
}

// 2 and 4 Caddy instances on one redis-server, clients hammering one key
// (max 100, window 10s, sync 100ms) through all of them for a second: with
// sync share the fleet admits within max + (N-1)·⌈max/N⌉ (the bound of
// docs/redis.md), with sync all (the naive scheme, each instance spending
// all it last saw) within max + (N-1)·max; both figures are printed side by
// side. Redis then holds exactly what the fleet admitted.
func TestSyncFleetOneKey(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	const maxN, clients = 100, 6
	for _, n := range []int{2, 4} {
		t.Run(fmt.Sprintf("%d instances", n), func(t *testing.T) {
			zone := func(spend string) string { return fmt.Sprintf("e2e-sync-%d-%s", n, spend) }
			site := ":$PORT {" +
				syncZone("/share", zone("share"), "10s", maxN, []string{srv.Addr}, "100ms share") +
				syncZone("/all", zone("all"), "10s", maxN, []string{srv.Addr}, "100ms all") + "\n}"
			bases := make([]string, n)
			for i := range bases {
				bases[i] = startCaddyProcess(t, site)
			}
			warmUp(t, bases, "/share", "/all")
			untilWindowLeft(10*time.Second, 3*time.Second)
			admitted := map[string]int64{}
			for _, spend := range []string{"share", "all"} {
				var ok, other atomic.Int64
				var wg sync.WaitGroup
				stop := time.Now().Add(time.Second)
				for _, base := range bases {
					for range clients {
						wg.Go(func() {
							for time.Now().Before(stop) {
								switch st, _ := syncGet(t, base, "/"+spend, "hammered"); st {
								case http.StatusOK:
									ok.Add(1)
								case http.StatusTooManyRequests:
								default:
									other.Add(1)
								}
							}
						})
					}
				}
				wg.Wait()
				if other.Load() != 0 {
					t.Errorf("sync %s: %d responses neither 200 nor 429", spend, other.Load())
				}
				admitted[spend] = ok.Load()
			}
			time.Sleep(300 * time.Millisecond) // every instance's last counts reach Redis
			shareBound := maxN + (n-1)*((maxN+n-1)/n)
			allBound := maxN + (n-1)*maxN
			t.Logf("%d instances, max %d: sync share admitted %d (bound %d), sync all (naive) admitted %d (bound %d)",
				n, maxN, admitted["share"], shareBound, admitted["all"], allBound)
			if got := admitted["share"]; got < maxN || got > int64(shareBound) {
				t.Errorf("sync share admitted %d: want from %d to %d", got, maxN, shareBound)
			}
			if got := admitted["all"]; got < maxN || got > int64(allBound) {
				t.Errorf("sync all admitted %d: want from %d to %d", got, maxN, allBound)
			}
			for _, spend := range []string{"share", "all"} {
				if got := redisCount(t, rdb, zone(spend), "hammered"); got != admitted[spend] {
					t.Errorf("sync %s: Redis holds %d, the fleet admitted %d", spend, got, admitted[spend])
				}
			}
		})
	}
}

// 100,000 keys spread over 2 instances on one redis-server: when each
// window ends, Redis holds exactly what the fleet admitted in it.
func TestSyncExactManyKeys(t *testing.T) {
	srv := redistest.StartReal(t, "an in-process miniredis cannot keep up with 100,000 keys synced by two Caddy processes")
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{srv.Addr}})
	defer rdb.Close()
	testSyncExact(t, "e2e-sync-exact", []string{srv.Addr}, rdb, 100_000)
}

// The same exactness on a three-master Redis Cluster: each batch is one
// slot's.
func TestSyncExactCluster(t *testing.T) {
	addrs := redistest.StartCluster(t)
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: addrs})
	defer rdb.Close()
	testSyncExact(t, "e2e-sync-cluster", addrs, rdb, 100_000)
}

// testSyncExact sends, for each of keys keys, one request through each of
// two instances at once (max 1: the fleet admits one), and checks, as each
// window the responses name ends, that Redis holds for every key what the
// fleet admitted of it in that window, and that no key was admitted twice.
func testSyncExact(t *testing.T, zone string, addrs []string, rdb redis.UniversalClient, keys int) {
	// Windows long enough that a loaded machine reads each well before
	// its hash expires (checkBefore), and short enough to end twice.
	const window = 30 * time.Second
	site := ":$PORT {" + syncZone("/", zone, window.String(), 1, addrs, "100ms") + "\n}"
	bases := []string{startCaddyProcess(t, site), startCaddyProcess(t, site)}
	warmUp(t, bases, "/")
	var mu sync.Mutex
	admitted := map[int64]map[string]int64{} // window end → key → admitted
	var refused, total atomic.Int64
	next := atomic.Int64{}
	done := make(chan struct{})
	var wg sync.WaitGroup
	start := time.Now()
	for range 32 {
		wg.Go(func() {
			for {
				i := next.Add(1) - 1
				if i >= int64(keys) {
					return
				}
				key := "k" + strconv.FormatInt(i, 10)
				var pair sync.WaitGroup
				for _, base := range bases {
					pair.Go(func() {
						st, reset := syncGet(t, base, "/", key)
						total.Add(1)
						switch st {
						case http.StatusOK:
							mu.Lock()
							if admitted[reset] == nil {
								admitted[reset] = map[string]int64{}
							}
							admitted[reset][key]++
							mu.Unlock()
						case http.StatusTooManyRequests:
							refused.Add(1)
						default:
							t.Errorf("key %s: status %d", key, st)
						}
					})
				}
				pair.Wait()
			}
		})
	}
	go func() { wg.Wait(); close(done) }()
	// Each window is checked once it has ended and the instances have
	// synced, while its keys live (a window after its end).
	checked := map[int64]bool{}
	var sumWant, sumGot int64
	for finished, wait := false, done; ; {
		select {
		case <-wait:
			finished, wait = true, nil // a nil channel: the ticks go on
		case <-time.After(100 * time.Millisecond):
		}
		mu.Lock()
		var due []int64
		for end := range admitted {
			if !checked[end] && time.Now().After(time.Unix(end, 0).Add(checkAfter)) {
				due = append(due, end)
			}
		}
		mu.Unlock()
		for _, end := range due {
			checked[end] = true
			mu.Lock()
			counts := admitted[end]
			mu.Unlock()
			want, got := checkWindow(t, rdb, zone, end, counts)
			sumWant += want
			sumGot += got
		}
		if finished && len(checked) == len(admitted) {
			break
		}
	}
	t.Logf("%d requests for %d keys in %s: %d admitted, %d refused; Redis held %d in all",
		total.Load(), keys, time.Since(start).Round(time.Millisecond), sumWant, refused.Load(), sumGot)
}

// checkAfter is how long after its end a window is checked first: a few
// sync intervals. checkBefore is how long Redis has to hold all its
// counts: well within testSyncExact's windows (30s) past its end, when
// its hash expires.
const (
	checkAfter  = time.Second
	checkBefore = 15 * time.Second
)

// checkWindow compares what Redis holds for the window ending at end (Unix
// seconds) with counts, what the fleet admitted of each key in it, and
// returns both sums.
func checkWindow(t *testing.T, rdb redis.UniversalClient, zone string, end int64, counts map[string]int64) (want, got int64) {
	t.Helper()
	for _, n := range counts {
		want += n
	}
	// The last rounds of a loaded machine may land late (a round trip
	// that times out is sent again): Redis gets until checkBefore past the
	// window's end to hold all the fleet admitted.
	var fields map[string]int64
	reads, first, began := 0, int64(0), time.Since(time.Unix(end, 0)).Round(time.Millisecond)
	for {
		fields = syncWindows(t, rdb, zone, strconv.FormatInt(end*1000, 10))[end*1000]
		got = 0
		for k := range counts {
			got += fields["caddy_rate_limit:"+zone+":{key:"+k+"}:g"]
		}
		if reads++; reads == 1 {
			first = got
		}
		if got >= want || time.Now().After(time.Unix(end, 0).Add(checkBefore)) {
			break
		}
		time.Sleep(25 * time.Millisecond) // a read of a loaded Redis takes far longer
	}
	late := time.Since(time.Unix(end, 0)).Round(time.Millisecond)
	wrong := 0
	for k, n := range counts {
		held := fields["caddy_rate_limit:"+zone+":{key:"+k+"}:g"]
		if n > 1 || held != n {
			if wrong++; wrong <= 5 {
				t.Errorf("window ending %s, key %s: the fleet admitted %d (max 1), Redis holds %d", time.Unix(end, 0).Format(time.TimeOnly), k, n, held)
			}
		}
	}
	t.Logf("window ending %s: the fleet admitted %d for %d keys, Redis holds %d (%d at the first of %d reads, from %s to %s after its end)", time.Unix(end, 0).Format(time.TimeOnly), want, len(counts), got, first, reads, began, late)
	if got != want {
		t.Errorf("window ending %s: Redis holds %d, the fleet admitted %d", time.Unix(end, 0).Format(time.TimeOnly), got, want)
	}
	return want, got
}

// Redis killed under traffic and restarted: no request fails, the zone
// reports DEGRADED meanwhile, and once Redis is back the instances push
// the running window's counts again, so that Redis holds all the fleet
// admitted in it, before the outage too.
func TestSyncRedisRestart(t *testing.T) {
	srv := redistest.StartReal(t, "the test kills and restarts the server")
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	const zone = "e2e-sync-restart"
	site := ":$PORT {" + syncZone("/", zone, "10s", 1000, []string{srv.Addr}, "100ms") + "\n}"
	a := startCaddy(t, "", site)
	bases := []string{a.Base, startCaddyProcess(t, site)}
	untilWindowLeft(10*time.Second, 6*time.Second)
	admitted := make([]atomic.Int64, 20)
	var failed atomic.Int64
	var statusMu sync.Mutex
	statuses := map[int]int{} // of the failed requests (0: no answer)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for c := range 8 {
		wg.Go(func() {
			for i := c; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				k := i % len(admitted)
				switch st, _ := syncGet(t, bases[i%2], "/", "k"+strconv.Itoa(k)); st {
				case http.StatusOK:
					admitted[k].Add(1)
				default:
					failed.Add(1)
					statusMu.Lock()
					statuses[st]++
					statusMu.Unlock()
				}
				time.Sleep(2 * time.Millisecond)
			}
		})
	}
	time.Sleep(time.Second)
	srv.Stop()
	degraded := eventuallyAcross(func() bool { return zoneHealth(t, zone) == "DEGRADED" })
	time.Sleep(500 * time.Millisecond)
	srv.Restart()
	healthy := eventuallyAcross(func() bool { return zoneHealth(t, zone) == "HEALTHY" })
	time.Sleep(500 * time.Millisecond)
	close(stop)
	wg.Wait()
	time.Sleep(300 * time.Millisecond)
	if !degraded || !healthy {
		t.Errorf("the zone reported DEGRADED while Redis was away: %t; HEALTHY once it was back: %t", degraded, healthy)
	}
	if failed.Load() != 0 {
		t.Errorf("%d requests failed (all should be admitted: max 1000), by status: %v", failed.Load(), statuses)
	}
	var want, got int64
	for k := range admitted {
		n := redisCount(t, rdb, zone, "k"+strconv.Itoa(k))
		want += admitted[k].Load()
		got += n
		if n != admitted[k].Load() {
			t.Errorf("key k%d: Redis holds %d, the fleet admitted %d", k, n, admitted[k].Load())
		}
	}
	t.Logf("admitted %d across the outage, Redis holds %d, %d failed", want, got, failed.Load())
	m := scrape(t, zone)
	trips, batches, keys := m[series("sync_round_trips_total", zone, "")], m[series("sync_batches_total", zone, "")], m[series("sync_keys_total", zone, "")]
	t.Logf("this instance: %.0f sync round trips, %.0f batches, %.0f keys, lag %.3fs, %.0f instances, %.0f dropped",
		trips, batches, keys, m[series("sync_lag_seconds", zone, "")], m[series("sync_instances", zone, "")], m[series("sync_dropped_deltas_total", zone, "")])
	if trips < 10 || batches < 10 || keys < batches || keys > 200*batches {
		t.Errorf("sync metrics: %.0f round trips, %.0f batches, %.0f keys", trips, batches, keys)
	}
	if lag := m[series("sync_lag_seconds", zone, "")]; lag <= 0 || lag > 1 {
		t.Errorf("sync lag %.3fs once Redis is back", lag)
	}
	if n := m[series("sync_instances", zone, "")]; n != 2 {
		t.Errorf("sync instances %.0f, want 2", n)
	}
	if d, ok := m[series("sync_dropped_deltas_total", zone, "")]; !ok || d != 0 {
		t.Errorf("dropped deltas %.0f (present: %t), want 0: 20 keys fit max_tracked", d, ok)
	}
	if zi := listedZone(t, zone); zi.Sync == nil || zi.Sync.Interval != "100ms" || zi.Sync.Spend != "share" || zi.Sync.Instances != 2 || zi.Sync.Lag <= 0 || zi.Sync.Lag > 1 {
		t.Errorf("the zone list's sync: %+v", zi.Sync)
	}
}

// zoneHealth returns the health the in-process instance's admin API
// reports for zone.
func zoneHealth(t *testing.T, zone string) string {
	return listedZone(t, zone).Health
}

// syncZoneInfo is what the tests read of a zone in the admin API's list.
type syncZoneInfo struct {
	Name   string `json:"name"`
	Health string `json:"health"`
	Sync   *struct {
		Interval  string  `json:"interval"`
		Spend     string  `json:"spend"`
		Lag       float64 `json:"lag_seconds"`
		Instances int     `json:"instances"`
	} `json:"sync"`
}

// listedZone returns what the in-process instance's admin API lists of
// zone.
func listedZone(t *testing.T, zone string) syncZoneInfo {
	status, body := admin(t, http.MethodGet, "/rate_limit/")
	if status != http.StatusOK {
		return syncZoneInfo{}
	}
	var zones []syncZoneInfo
	if err := json.Unmarshal([]byte(body), &zones); err != nil {
		t.Fatalf("zones: %v: %s", err, body)
	}
	for _, z := range zones {
		if z.Name == zone {
			return z
		}
	}
	return syncZoneInfo{}
}
