package limiter

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// syncFleet returns n stores in sync mode sharing one zone on addrs, as n
// Caddy instances would.
func syncFleet(t *testing.T, addrs []string, n int, opts RedisStoreOptions) []*SyncStore {
	t.Helper()
	if opts.Prefix == "" {
		opts.Prefix = "test:" + t.Name() + ":"
	}
	fleet := make([]*SyncStore, n)
	for i := range fleet {
		fleet[i], _ = newTestSyncStore(t, addrs, opts)
		fleet[i].markUsed()
	}
	return fleet
}

// alignedClock returns a clock that runs with the real one, set so that
// the window of w in progress (sync windows are aligned to the clock) has
// just begun: a test has all of it, and of any longer window that w
// divides at least w. It is off the real clock by at most w/2, so that
// Redis, which expires keys on its own clock, sees the same window of
// every key (redis_sync.lua tells windows apart by that).
func alignedClock(w time.Duration) clock.Clock {
	into := time.Duration(time.Now().UnixNano() % int64(w))
	offset := -into
	if into > w/2 {
		offset = w - into
	}
	return offsetClock{offset}
}

// offsetClock is the real clock, off by a fixed duration.
type offsetClock struct{ by time.Duration }

func (c offsetClock) Now() time.Time                       { return time.Now().Add(c.by) }
func (offsetClock) NewTimer(d time.Duration) clock.Timer   { return clock.Real.NewTimer(d) }
func (offsetClock) NewTicker(d time.Duration) clock.Ticker { return clock.Real.NewTicker(d) }
func (offsetClock) AfterFunc(d time.Duration, f func()) clock.Timer {
	return clock.Real.AfterFunc(d, f)
}

// waitSynced waits until every store of the fleet has had a round that
// started after now (by its clock).
func waitSynced(t *testing.T, fleet []*SyncStore) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for _, s := range fleet {
		from := s.clock.Now()
		for s.table.lastOK.Load() <= from.UnixNano() {
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
				limit := Limit{Window: 10 * time.Second, Max: 100}
				clk := alignedClock(limit.Window)
				fleet := syncFleet(t, []string{srv.Addr}, n, RedisStoreOptions{Sync: 100 * time.Millisecond, SyncSpend: spend, Clock: clk})
				waitSynced(t, fleet)
				waitSynced(t, fleet)
				var admitted atomic.Int64
				var wg sync.WaitGroup
				stop := time.Now().Add(time.Second)
				for _, s := range fleet {
					for range 2 {
						wg.Go(func() {
							for time.Now().Before(stop) {
								v, err := s.Hit(context.Background(), "hammered", clk.Now(), limit)
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
				waitSynced(t, fleet)
				got := count(t, fleet[0], "hammered")
				t.Logf("%d instances, spend %s: admitted %d of max %d; Redis holds %d", n, spend, admitted.Load(), limit.Max, got)
				if got != admitted.Load() {
					t.Errorf("Redis holds %d, the fleet admitted %d", got, admitted.Load())
				}
				// The bounds of docs/redis.md, for clients hammering the
				// key on every instance from the window's start.
				bound := int64(limit.Max + (n-1)*limit.Max)
				if spend == SyncShare {
					bound = int64(limit.Max + (n-1)*((limit.Max+n-1)/n))
				}
				if a := admitted.Load(); a < int64(limit.Max) || a > bound {
					t.Errorf("admitted %d, want from %d to %d", a, limit.Max, bound)
				}
			})
		}
	}
}

// manualFleet is syncFleet with rounds the test runs (round): the loop's
// interval is too long to run any after its first.
func manualFleet(t *testing.T, srv *redistest.Server, n int, opts RedisStoreOptions) []*SyncStore {
	t.Helper()
	opts.Sync = MaxSyncInterval
	fleet := syncFleet(t, []string{srv.Addr}, n, opts)
	for _, s := range fleet {
		<-s.table.ready
	}
	return fleet
}

// listeningSync is listening for a store in sync mode: once it returns, s
// hears the unblocks announced (they drop entries of its table).
func listeningSync(t testing.TB, s *SyncStore) {
	t.Helper()
	s.markUsed()
	const probe = "listening-probe"
	y := s.table
	ck := cacheKey("", probe)
	i, h := y.hashOf(ck)
	sh := &y.shards[i]
	held := func() bool {
		sh.mu.Lock()
		defer sh.mu.Unlock()
		return sh.slab.find(h, ck) != nil
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		sh.mu.Lock()
		y.entry(i, h, ck, &Check{Key: probe, Limit: Limit{Window: time.Minute, Max: 1}}, time.Now().UnixMilli())
		sh.mu.Unlock()
		s.client.Publish(context.Background(), s.unblockChannel(), "\x00"+probe)
		for wait := time.Now().Add(100 * time.Millisecond); time.Now().Before(wait); time.Sleep(5 * time.Millisecond) {
			if !held() {
				return
			}
		}
	}
	t.Fatal("the store never heard its unblock channel")
}

// round runs one sync round of each store, in order.
func round(fleet ...*SyncStore) {
	for _, s := range fleet {
		s.syncRound(context.Background(), s.clock.Now())
	}
}

// count returns the fleet's count Redis holds for tag in s's zone's first
// limit, in the newest window it counts.
func count(t *testing.T, s *SyncStore, tag string) int64 {
	t.Helper()
	return held(t, s, "", tag, false)
}

// held returns the fleet's count Redis holds for tag in the named limit of
// s's zone, in the newest window it counts, or (prev) the window before.
func held(t *testing.T, s *SyncStore, name, tag string, prev bool) int64 {
	t.Helper()
	ctx := context.Background()
	hashes, err := s.client.Keys(ctx, escapeGlob(s.prefix)+"w:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	field := s.keyOf(name, tag, "g")
	counts := map[int64]int64{} // by the window's start
	newest, start := int64(0), int64(0)
	for _, h := range hashes {
		_, end, length, ok := s.parseWindowKey(h)
		v, err := s.client.HGet(ctx, h, field).Result()
		if !ok || err != nil {
			continue
		}
		n, err := fleetCount(v)
		if err != nil {
			continue // not the module's (TestRedisSyncDamagedKeysStartAfresh): the listing skips it too
		}
		counts[end] = int64(n)
		if end > newest {
			newest, start = end, end-length
		}
	}
	if prev {
		return counts[start]
	}
	return counts[newest]
}

// admit sends n decisions for key to s and returns how many were admitted.
func admit(t *testing.T, s *SyncStore, key string, limit Limit, n int) int {
	t.Helper()
	ok := 0
	for range n {
		v, err := s.Hit(context.Background(), key, s.clock.Now(), limit)
		if err != nil {
			t.Fatal(err)
		}
		if v.Allowed {
			ok++
		}
	}
	return ok
}

// An unblock drops the counts every instance had not sent yet: no late
// count brings the key back. A refund is a lower count.
func TestRedisSyncUnblockAndRefund(t *testing.T) {
	srv := redistest.Start(t)
	limit := Limit{Window: time.Minute, Max: 10}
	fleet := manualFleet(t, srv, 2, RedisStoreOptions{SyncSpend: SyncAll, Clock: alignedClock(limit.Window)})
	a, b := fleet[0], fleet[1]
	a.SetLimits([]Check{{Limit: limit}}) // an unblock deletes the key's counts of the limit's windows
	listeningSync(t, b)
	if got := admit(t, a, "u", limit, 3) + admit(t, b, "u", limit, 2); got != 5 {
		t.Fatalf("admitted %d of 5", got)
	}
	round(a, b)
	if got := count(t, a, "u"); got != 5 {
		t.Fatalf("Redis holds %d, want 5", got)
	}
	admit(t, a, "u", limit, 2)
	admit(t, b, "u", limit, 2) // neither sent
	if found, err := a.Forget(context.Background(), "u"); err != nil || !found {
		t.Fatalf("forget: %t %v", found, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for b.Len() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // b hears of the unblock
	}
	round(a, b)
	if got := count(t, a, "u"); got != 0 {
		t.Errorf("after the unblock Redis holds %d for the key, want 0: a late count brought it back", got)
	}
	// A refund gives back a unit of the window it was admitted in.
	var out [1]Verdict
	checks := []Check{{Key: "r", Limit: limit}}
	if err := a.Decide(context.Background(), checks, a.clock.Now(), out[:]); err != nil || !out[0].Allowed {
		t.Fatalf("decide: %+v %v", out[0], err)
	}
	admit(t, a, "r", limit, 2)
	round(a)
	if err := a.Refund(context.Background(), checks, a.clock.Now(), out[:]); err != nil {
		t.Fatal(err)
	}
	round(a)
	if got := count(t, a, "r"); got != 2 {
		t.Errorf("after a refund Redis holds %d, want 2", got)
	}
}

// A ban started on one instance holds on another from its first round
// after the key reaches it.
func TestRedisSyncBanSpreads(t *testing.T) {
	srv := redistest.Start(t)
	limit := Limit{Window: time.Minute, Max: 2, Ban: time.Hour}
	fleet := manualFleet(t, srv, 2, RedisStoreOptions{Clock: alignedClock(limit.Window)})
	a, b := fleet[0], fleet[1]
	// The instance of the lower id has the spare share of a new key
	// (half of the 2): the other waits for its round's lease.
	if got := admit(t, b, "x", limit, 1); got == 0 {
		round(b)
		if got = admit(t, b, "x", limit, 1); got != 1 {
			t.Fatalf("b admitted %d of 1 after its round", got)
		}
	}
	round(a, b)
	// So may a's, and b may hold the one left in the lease it asked for
	// (twice its demand): b gives it back at its next round, having no
	// more requests of the key, and a's next round leases it.
	got := admit(t, a, "x", limit, 1)
	round(b, a)
	if got += admit(t, a, "x", limit, 3); got != 1 {
		t.Fatalf("a admitted %d of 4 (the one left)", got)
	}
	round(a, b)
	// b hears of the ban at its first round after the key reaches it.
	admit(t, b, "x", limit, 1)
	round(b)
	for name, s := range map[string]*SyncStore{"a": a, "b": b} {
		v, err := s.Hit(context.Background(), "x", s.clock.Now(), limit)
		if err != nil || v.Allowed || v.RetryAfter < 59*time.Minute {
			t.Errorf("%s after the rounds: %+v %v, want a refusal for the hour's ban", name, v, err)
		}
	}
}

// While Redis is away decisions go on in memory, the zone is DEGRADED,
// the counts it cannot hold past max_tracked are dropped oldest first (and
// counted); when Redis is back, it gets the running window's counts again,
// those sent before the restart too.
func TestRedisSyncOutage(t *testing.T) {
	srv := redistest.StartReal(t, "the test stops and restarts the server")
	limit := Limit{Window: time.Minute, Max: 10}
	fleet := manualFleet(t, srv, 1, RedisStoreOptions{MaxTracked: 10, SyncSpend: SyncAll, Timeout: time.Second, Clock: alignedClock(limit.Window)})
	s := fleet[0]
	admit(t, s, "sent", limit, 4)
	round(s)
	// A hung Redis: a decision that waited for it would take the
	// timeout, a second, each.
	if !srv.Pause() {
		t.Fatal("cannot pause redis-server")
	}
	start := time.Now()
	admit(t, s, "hung", limit, 10)
	if d := time.Since(start); d >= time.Second {
		t.Errorf("10 decisions took %s with Redis hung: they waited for it", d)
	}
	srv.Resume()
	srv.Stop()
	for i := range 20 {
		if got := admit(t, s, "k"+strconv.Itoa(i), limit, 2); got != 2 {
			t.Fatalf("key %d: admitted %d of 2 while Redis was away", i, got)
		}
	}
	for range 3 {
		round(s)
	}
	if s.Health() != HealthDegraded {
		t.Errorf("health %s after three failed rounds, want %s", s.Health(), HealthDegraded)
	}
	st := s.SyncStats(time.Now())
	if st.Dropped != 11 {
		// 22 keys, 10 held: the oldest 12 go, of which all but the key
		// synced before the outage had counts Redis lacks.
		t.Errorf("dropped %d keys' counts, want 11", st.Dropped)
	}
	srv.Restart()
	deadline := time.Now().Add(10 * time.Second)
	for s.Health() == HealthDegraded && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond) // the probe finds Redis back
	}
	round(s)
	for i := 10; i < 20; i++ {
		if got := count(t, s, "k"+strconv.Itoa(i)); got != 2 {
			t.Errorf("key k%d: Redis holds %d after the restart, want 2", i, got)
		}
	}
	if got := count(t, s, "k0"); got != 0 {
		t.Errorf("key k0 (dropped): Redis holds %d", got)
	}
}

// Sliding windows and costs in sync mode: a costly request that does not
// fit spends nothing, the previous window's count weighs on the next, and
// Redis holds each window's count where the fleet reads it.
func TestRedisSyncSlidingCost(t *testing.T) {
	srv := redistest.Start(t)
	limit := Limit{Window: time.Second, Max: 10, Algorithm: SlidingWindow}
	clk := alignedClock(limit.Window)
	s := manualFleet(t, srv, 1, RedisStoreOptions{Clock: clk})[0]
	decide := func(cost int) Verdict {
		var out [1]Verdict
		if err := s.Decide(context.Background(), []Check{{Key: "s", Limit: limit, Cost: cost}}, clk.Now(), out[:]); err != nil {
			t.Fatal(err)
		}
		return out[0]
	}
	for i, want := range []bool{true, true, false} {
		if v := decide(4); v.Allowed != want {
			t.Fatalf("request %d of cost 4: admitted %t, want %t (%+v)", i, v.Allowed, want, v)
		}
	}
	round(s)
	if got := count(t, s, "s"); got != 8 {
		t.Fatalf("Redis holds %d, want 8", got)
	}
	// The next window: the 8 weigh almost fully at its start.
	now := clk.Now()
	time.Sleep(now.Truncate(limit.Window).Add(limit.Window).Sub(now))
	if v := decide(1); !v.Allowed {
		t.Errorf("cost 1 at the next window's start refused: %+v", v)
	}
	if v := decide(4); v.Allowed || v.RetryAfter <= 0 {
		t.Errorf("cost 4 at the next window's start: %+v, want a refusal with a wait", v)
	}
	round(s)
	if prev := held(t, s, "", "s", true); prev != 8 || count(t, s, "s") != 1 {
		t.Errorf("Redis holds %d as the previous count and %d as the count, want 8 and 1", prev, count(t, s, "s"))
	}
}

// Several limits in sync mode make one verdict: a request one limit refuses
// counts in none, and each limit's count reaches Redis under its name.
func TestRedisSyncSeveralLimits(t *testing.T) {
	srv := redistest.Start(t)
	minute := Limit{Window: time.Minute, Max: 10}
	burst := Limit{Window: 10 * time.Second, Max: 2}
	s := manualFleet(t, srv, 1, RedisStoreOptions{Clock: alignedClock(burst.Window)})[0] // the minute has 10s left at least
	checks := []Check{{Key: "m", Limit: minute}, {Slot: 1, Name: "burst", Key: "m", Limit: burst}}
	var got []bool
	for range 4 {
		var out [2]Verdict
		if err := s.Decide(context.Background(), checks, s.clock.Now(), out[:]); err != nil {
			t.Fatal(err)
		}
		got = append(got, out[0].Allowed && out[1].Allowed)
		if !out[0].Allowed {
			t.Errorf("the minute's limit refused: %+v", out[0])
		}
	}
	if fmt.Sprint(got) != "[true true false false]" {
		t.Errorf("admitted %v, want the first two", got)
	}
	round(s)
	for _, name := range []string{"", "burst"} {
		if n := held(t, s, name, "m", false); n != 2 {
			t.Errorf("limit %q: Redis holds %d, want 2", name, n)
		}
	}
}

// With hash_keys, sync mode writes only the keys' HMACs to Redis, and an
// unblock by the hash drops the instance's count of the key.
func TestRedisSyncHashedKeys(t *testing.T) {
	srv := redistest.Start(t)
	limit := Limit{Window: time.Minute, Max: 5}
	s := manualFleet(t, srv, 1, RedisStoreOptions{HashKey: []byte("secret"), Clock: alignedClock(limit.Window)})[0]
	s.SetLimits([]Check{{Limit: limit}})
	admit(t, s, "203.0.113.7", limit, 3)
	round(s)
	ctx := context.Background()
	keys, err := s.client.Keys(ctx, s.prefix+"*").Result()
	if err != nil {
		t.Fatal(err)
	}
	fields := 0
	for _, k := range keys {
		if strings.Contains(k, "203.0.113.7") {
			t.Errorf("Redis holds the raw key: %s", k)
		}
		if _, _, _, ok := s.parseWindowKey(k); ok {
			hk, err := s.client.HKeys(ctx, k).Result()
			if err != nil {
				t.Fatal(err)
			}
			for _, f := range hk {
				fields++
				if strings.Contains(f, "203.0.113.7") {
					t.Errorf("Redis holds the raw key in %s: %s", k, f)
				}
			}
		}
	}
	if fields == 0 {
		t.Errorf("no window hash holds a field (keys: %v)", keys)
	}
	if got := count(t, s, s.Tag("203.0.113.7")); got != 3 {
		t.Fatalf("Redis holds %d under the key's hash, want 3 (keys: %v)", got, keys)
	}
	admit(t, s, "203.0.113.7", limit, 1) // not sent yet
	if found, err := s.Forget(ctx, s.Tag("203.0.113.7")); err != nil || !found {
		t.Fatalf("forget by hash: %t %v", found, err)
	}
	if s.Len() != 0 {
		t.Errorf("the instance still holds %d keys after the unblock", s.Len())
	}
	round(s)
	if got := count(t, s, s.Tag("203.0.113.7")); got != 0 {
		t.Errorf("after the unblock Redis holds %d", got)
	}
}

// What sync mode did not write under the zone's prefix (a window's hash
// that is a string or a list, a key's field of other bytes, a record of an
// id of another length) starts those counts afresh: the round does not
// fail, Redis then holds the instance's count, and the listing, which
// skips a damaged count, reads it. Each case has windows of its own
// length, so its own hashes.
func TestRedisSyncDamagedKeysStartAfresh(t *testing.T) {
	srv := redistest.Start(t)
	s := manualFleet(t, srv, 1, RedisStoreOptions{Clock: alignedClock(time.Minute)})[0] // every whole-minute window has a minute left
	ctx := context.Background()
	damages := map[string]func(h, f string) error{
		"string": func(h, _ string) error { return s.client.Set(ctx, h, "many", 0).Err() },
		"list":   func(h, _ string) error { return s.client.RPush(ctx, h, "1").Err() },
		"text":   func(h, f string) error { return s.client.HSet(ctx, h, f, "5/0/0").Err() },
		"id":     func(h, f string) error { return s.client.HSet(ctx, h, f, appendRecord(nil, "other", 5, 0, 0)).Err() },
	}
	want := map[string]int{}
	minutes := 1
	for what, damage := range damages {
		// The running window's hash, and the previous one's, which a
		// sliding window reads every round.
		for _, prev := range []bool{false, true} {
			limit := Limit{Window: time.Duration(minutes) * time.Minute, Max: 10}
			minutes++
			key := what + "-running"
			if prev {
				limit.Algorithm = SlidingWindow
				key = what + "-previous"
			}
			if n := admit(t, s, key, limit, 3); n != 3 {
				t.Fatalf("%s: admitted %d of 3", key, n)
			}
			round(s)
			end, length := syncWindowAt(limit, s.clock.Now().UnixMilli())
			if prev {
				end -= length
			}
			h, f := s.windowKey("0", end, length), s.keyOf("", key, "g")
			if err := s.client.Del(ctx, h).Err(); err != nil {
				t.Fatal(err)
			}
			if err := damage(h, f); err != nil {
				t.Fatal(err)
			}
			s.SetLimits([]Check{{Limit: limit}}) // the listing reads the limit's windows
			if err := s.Range(ctx, s.clock.Now(), func(KeyState) bool { return true }); err != nil {
				t.Fatalf("%s: listing with the damaged key: %v", key, err)
			}
			if n := admit(t, s, key, limit, 2); n != 2 {
				t.Fatalf("%s: admitted %d of 2 after the damage", key, n)
			}
			round(s)
			if c := count(t, s, key); c != 5 {
				t.Errorf("%s: Redis holds %d, want 5", key, c)
			}
			got := 0
			if err := s.Range(ctx, s.clock.Now(), func(ks KeyState) bool {
				if ks.Key == key {
					got = ks.Count
				}
				return true
			}); err != nil {
				t.Fatal(err)
			}
			if got != 5 {
				t.Errorf("%s: the listing reads %d, want 5", key, got)
			}
			want[key] = 5
		}
	}
	if h := s.Health(); h != HealthHealthy {
		t.Fatalf("health %s after rounds over damaged keys, want HEALTHY", h)
	}
	if len(want) != 2*len(damages) {
		t.Errorf("%d cases ran, want %d", len(want), 2*len(damages))
	}
}

// The listing of a zone in sync mode reads the window hashes: each key
// counted in its limit's running window once, with its fleet's count, the
// window's end, its refused tally and, sliding, the previous window's
// count; a banned key with no count in the running window on its own; and
// neither a window of another length (a reload's) nor a key unblocked.
func TestRedisSyncListing(t *testing.T) {
	srv := redistest.Start(t)
	fixed := Limit{Window: time.Minute, Max: 3}
	sliding := Limit{Window: time.Minute, Max: 10, Algorithm: SlidingWindow}
	s := manualFleet(t, srv, 1, RedisStoreOptions{Clock: alignedClock(time.Minute)})[0]
	s.SetLimits([]Check{{Limit: fixed}, {Slot: 1, Name: "s", Limit: sliding}})
	ctx := context.Background()
	if n := admit(t, s, "a", fixed, 5); n != 3 {
		t.Fatalf("admitted %d of 5, want 3", n)
	}
	var out [1]Verdict
	if err := s.Decide(ctx, []Check{{Slot: 1, Name: "s", Key: "p", Limit: sliding}}, s.clock.Now(), out[:]); err != nil || !out[0].Allowed {
		t.Fatalf("the sliding limit: %+v %v", out[0], err)
	}
	round(s)
	end, length := syncWindowAt(fixed, s.clock.Now().UnixMilli())
	other := "ooooooooooooo"
	for _, err := range []error{
		// Another instance counted 4 of p in the window before.
		s.client.HSet(ctx, s.windowKey("0", end-length, length), s.keyOf("s", "p", "g"), appendRecord(nil, other, 4, 0, 0)).Err(),
		// Windows of two minutes, as before a reload.
		s.client.HSet(ctx, s.windowKey("0", end, 2*length), s.keyOf("", "a", "g"), appendRecord(nil, other, 9, 0, 0)).Err(),
		s.client.Set(ctx, s.keyOf("", "b", "b"), 1, 30*time.Second).Err(),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	list := func() map[string]KeyState {
		t.Helper()
		got := map[string]KeyState{}
		if err := s.Range(ctx, s.clock.Now(), func(ks KeyState) bool {
			k := ks.Name + "/" + ks.Key
			if _, twice := got[k]; twice {
				t.Errorf("%s listed twice", k)
			}
			got[k] = ks
			return true
		}); err != nil {
			t.Fatal(err)
		}
		return got
	}
	got := list()
	if a := got["/a"]; a.Count != 3 || a.Refused != 2 || !a.Reset.Equal(time.UnixMilli(end)) {
		t.Errorf("a: count %d, refused %d, reset %v; want 3, 2 and %v", a.Count, a.Refused, a.Reset, time.UnixMilli(end))
	}
	if p := got["s/p"]; p.Count != 1 || p.Prev != 4 {
		t.Errorf("p: count %d, previous %d; want 1 and 4", p.Count, p.Prev)
	}
	if b := got["/b"]; b.BannedUntil.IsZero() || b.Count != 0 {
		t.Errorf("b: %+v, want a ban alone", b)
	}
	if len(got) != 3 {
		t.Errorf("listed %v, want a, p and b", got)
	}
	if found, err := s.Forget(ctx, "a"); err != nil || !found {
		t.Fatalf("forget: %t %v", found, err)
	}
	if a, ok := list()["/a"]; ok {
		t.Errorf("a listed after its unblock: %+v", a)
	}
}
