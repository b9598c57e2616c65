package limiter

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// decide runs Decide and fails the test on an error.
func decide(t testing.TB, s Store, now time.Time, checks ...Check) ([]Verdict, bool) {
	t.Helper()
	out := make([]Verdict, len(checks))
	if err := s.Decide(context.Background(), checks, now, out); err != nil {
		t.Fatalf("Decide: %v", err)
	}
	admitted := true
	for _, v := range out {
		admitted = admitted && v.Allowed
	}
	return out, admitted
}

// twoLimits is a per-client limit of 3 and a shared tenant limit of 5.
func twoLimits(client string, window time.Duration) []Check {
	return []Check{
		{Slot: 0, Key: client, Limit: Limit{Window: window, Max: 3}},
		{Slot: 1, Name: "tenant", Key: "key:acme", Limit: Limit{Window: window, Max: 5}},
	}
}

// testDecideNoPartialCount checks the contract of Decide on any store: a
// request is admitted only when every limit admits it, a refused request
// leaves no count in any limit, and each refusing limit tallies it.
func testDecideNoPartialCount(t *testing.T, s Store, now time.Time) {
	t.Helper()
	// Client a spends its 3; the tenant has 2 left.
	for i := range 3 {
		if _, ok := decide(t, s, now, twoLimits("a", time.Minute)...); !ok {
			t.Fatalf("a's request %d refused", i+1)
		}
	}
	out, ok := decide(t, s, now, twoLimits("a", time.Minute)...)
	if ok || out[0].Allowed || !out[1].Allowed || out[1].Remaining != 2 || !out[0].FirstRefusal {
		t.Fatalf("a's 4th = %+v, want refused by its own limit, the tenant's 2 left untouched", out)
	}
	// Client b spends the tenant's last 2; its third is refused by the
	// tenant, and b's own limit keeps its 1 left.
	for range 2 {
		if _, ok := decide(t, s, now, twoLimits("b", time.Minute)...); !ok {
			t.Fatal("b refused while the tenant had room")
		}
	}
	out, ok = decide(t, s, now, twoLimits("b", time.Minute)...)
	if ok || !out[0].Allowed || out[0].Remaining != 1 || out[1].Allowed || out[1].RetryAfter <= 0 {
		t.Fatalf("b's 3rd = %+v, want refused by the tenant, b's own count left at 2", out)
	}
	var states []KeyState
	if err := s.Range(context.Background(), now, func(ks KeyState) bool { states = append(states, ks); return true }); err != nil {
		t.Fatal(err)
	}
	got := map[string]KeyState{}
	for _, ks := range states {
		got[ks.Name+"/"+ks.Key] = ks
	}
	for k, want := range map[string][2]int{"/a": {3, 1}, "/b": {2, 0}, "tenant/key:acme": {5, 1}} {
		if ks := got[k]; ks.Count != want[0] || ks.Refused != want[1] {
			t.Errorf("%s: count %d refused %d, want %d and %d (all: %+v)", k, ks.Count, ks.Refused, want[0], want[1], states)
		}
	}
	// Forget reaches the key in every limit; ForgetCheck in one.
	if ok, err := s.ForgetCheck(context.Background(), Check{Slot: 1, Name: "tenant", Key: "key:acme"}); !ok || err != nil {
		t.Fatalf("ForgetCheck tenant: %t, %v", ok, err)
	}
	if out, ok := decide(t, s, now, twoLimits("b", time.Minute)...); !ok || out[1].Remaining != 4 {
		t.Fatalf("after forgetting the tenant: %+v, want admitted with 4 left", out)
	}
}

func TestMemoryDecideNoPartialCount(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	s.SetSlotName(1, "tenant")
	testDecideNoPartialCount(t, s, t0)
}

func TestRedisDecideNoPartialCount(t *testing.T) {
	srv := redistest.Start(t)
	s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	if s.pipe != nil {
		t.Fatal("the store decides through the auto-pipeliner by default")
	}
	s.SetLimits([]Check{{}, {Slot: 1, Name: "tenant"}})
	testDecideNoPartialCount(t, s, time.Now())
}

// The same through the auto-pipeliner (pipeline on).
func TestRedisDecideNoPartialCountPipelined(t *testing.T) {
	srv := redistest.Start(t)
	s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Pipeline: true})
	if s.pipe == nil {
		t.Fatal("a Pipeline store has no auto-pipeliner")
	}
	s.SetLimits([]Check{{}, {Slot: 1, Name: "tenant"}})
	testDecideNoPartialCount(t, s, time.Now())
}

func TestRedisClusterDecideNoPartialCount(t *testing.T) {
	s, _ := newTestRedisStore(t, redistest.StartCluster(t), RedisStoreOptions{})
	s.SetLimits([]Check{{}, {Slot: 1, Name: "tenant"}})
	if clusterSlot(s.base("", "a")+"c") == clusterSlot(s.base("tenant", "key:acme")+"c") {
		t.Fatal("the test's keys share a slot: the cross-slot path is not exercised")
	}
	testDecideNoPartialCount(t, s, time.Now())
}

// testDecideConcurrent sends 64 concurrent clients' requests, each judged by
// a per-client burst and sustained limit and a per-tenant burst and
// sustained limit over 4 tenants, and checks that no limit ever admits more
// than its max and that every count is exactly the requests admitted: no
// refused request left a count.
func testDecideConcurrent(t *testing.T, s Store, now time.Time, perClient int) {
	t.Helper()
	const clients, tenants = 64, 4
	limits := []Limit{
		{Window: time.Minute, Max: 5},  // client burst
		{Window: time.Hour, Max: 8},    // client sustained
		{Window: time.Minute, Max: 30}, // tenant burst
		{Window: time.Hour, Max: 60},   // tenant sustained
	}
	names := []string{"", "client-hour", "tenant-min", "tenant-hour"}
	var admittedBy [clients]atomic.Int64
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			client, tenant := fmt.Sprintf("c%d", c), fmt.Sprintf("key:t%d", c%tenants)
			for range perClient {
				checks := make([]Check, 4)
				for i := range checks {
					key := client
					if i >= 2 {
						key = tenant
					}
					checks[i] = Check{Slot: i, Name: names[i], Key: key, Limit: limits[i]}
				}
				out := make([]Verdict, 4)
				if err := s.Decide(context.Background(), checks, now, out); err != nil {
					t.Error(err)
					return
				}
				if out[0].Allowed && out[1].Allowed && out[2].Allowed && out[3].Allowed {
					admittedBy[c].Add(1)
				}
			}
		})
	}
	wg.Wait()
	perTenant := map[string]int64{}
	total := int64(0)
	for c := range clients {
		n := admittedBy[c].Load()
		if n > 5 {
			t.Errorf("client c%d admitted %d, over its burst of 5", c, n)
		}
		perTenant[fmt.Sprintf("key:t%d", c%tenants)] += n
		total += n
	}
	for tenant, n := range perTenant {
		if n > 30 {
			t.Errorf("tenant %s admitted %d, over its burst of 30", tenant, n)
		}
	}
	if total == 0 {
		t.Fatal("nothing admitted")
	}
	counts := map[string]int{}
	if err := s.Range(context.Background(), now, func(ks KeyState) bool { counts[ks.Name+"/"+ks.Key] = ks.Count; return true }); err != nil {
		t.Fatal(err)
	}
	for c := range clients {
		client := fmt.Sprintf("c%d", c)
		for _, name := range names[:2] {
			if got := int64(counts[name+"/"+client]); got != admittedBy[c].Load() {
				t.Errorf("limit %q of %s counts %d, admitted %d", name, client, got, admittedBy[c].Load())
			}
		}
	}
	for tenant, n := range perTenant {
		for _, name := range names[2:] {
			if got := int64(counts[name+"/"+tenant]); got != n {
				t.Errorf("limit %q of %s counts %d, admitted %d", name, tenant, got, n)
			}
		}
	}
	t.Logf("%d clients x %d requests: %d admitted", clients, perClient, total)
}

func TestMemoryDecideConcurrent(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(10_000)
	for i, n := range []string{"", "client-hour", "tenant-min", "tenant-hour"} {
		s.SetSlotName(i, n)
	}
	testDecideConcurrent(t, s, t0, 20)
}

func TestRedisDecideConcurrent(t *testing.T) {
	srv := redistest.Start(t)
	s, _ := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{Timeout: 5 * time.Second})
	testDecideConcurrent(t, s, time.Now(), 10)
}

func TestRedisClusterDecideConcurrent(t *testing.T) {
	s, _ := newTestRedisStore(t, redistest.StartCluster(t), RedisStoreOptions{Timeout: 5 * time.Second})
	testDecideConcurrent(t, s, time.Now(), 10)
}

// A scripted burst at the end of one window and the start of the next: the
// fixed window admits up to 2 x max across the edge, the sliding window at
// most max + 1.
func TestWindowEdgeBurst(t *testing.T) {
	t.Parallel()
	const max = 10
	for _, tc := range []struct {
		algo Algorithm
		most int
	}{{FixedWindow, 2 * max}, {SlidingWindow, max + 1}} {
		s := NewMemoryStore(1000)
		lim := Limit{Window: time.Minute, Max: max, Algorithm: tc.algo}
		hit(t, s, "warm", t0, lim) // the key's window starts at t0
		s.Forget(bg, "warm")
		hit(t, s, "k", t0, lim)
		admitted := 1
		// Every 100ms from 1s before the edge to 1s after it.
		for at := 59 * time.Second; at <= 61*time.Second; at += 100 * time.Millisecond {
			for range max {
				if hit(t, s, "k", t0.Add(at), lim).Allowed {
					admitted++
				}
			}
		}
		if admitted > tc.most || admitted < max || (!lim.Sliding() && admitted != 2*max) {
			t.Errorf("sliding %t: %d admitted across the edge, want %d to %d", lim.Sliding(), admitted, max, tc.most)
		}
		t.Logf("sliding %t: %d admitted in the 2 s around the window edge (max %d)", lim.Sliding(), admitted, max)
	}
}

// The sliding window over a steady stream admits about max per window and
// tells a refused client how long to wait.
func TestSlidingWindowSteady(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(1000)
	lim := Limit{Window: 10 * time.Second, Max: 10, Algorithm: SlidingWindow}
	rng := rand.New(rand.NewPCG(1, 2))
	admittedAt := []time.Duration{}
	now := time.Duration(0)
	for now < 100*time.Second {
		now += time.Duration(rng.Int64N(int64(300 * time.Millisecond)))
		v := hit(t, s, "k", t0.Add(now), lim)
		if v.Allowed {
			admittedAt = append(admittedAt, now)
		} else if v.RetryAfter <= 0 || v.RetryAfter > 20*time.Second {
			t.Fatalf("refused at %s with RetryAfter %s", now, v.RetryAfter)
		}
	}
	// In any 10 s span, at most max + 1 (the estimate's rounding).
	for i := range admittedAt {
		n := 0
		for j := i; j < len(admittedAt) && admittedAt[j]-admittedAt[i] < 10*time.Second; j++ {
			n++
		}
		if n > 11 {
			t.Fatalf("%d admitted in the 10 s from %s", n, admittedAt[i])
		}
	}
	if len(admittedAt) < 80 {
		t.Errorf("%d admitted in 100 s at max 10 per 10 s, want about 100", len(admittedAt))
	}
}

// Decide of two limits costs about twice Hit of one, and neither allocates
// for keys already tracked.
func BenchmarkMemoryDecide(b *testing.B) {
	for _, n := range []int{1, 2, 4} {
		b.Run(fmt.Sprintf("limits=%d", n), func(b *testing.B) {
			s := NewMemoryStore(1_000_000)
			keys := make([]string, 10_000)
			for i := range keys {
				keys[i] = fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&255, i&255)
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				checks := make([]Check, n)
				out := make([]Verdict, n)
				i := rand.IntN(len(keys))
				now := time.Now()
				for pb.Next() {
					i = (i + 1) % len(keys)
					for j := range checks {
						checks[j] = Check{Slot: j, Key: keys[i], Limit: Limit{Window: time.Hour, Max: 1 << 30}}
					}
					if err := s.Decide(context.Background(), checks, now, out); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}

// The Redis sliding window carries the last window's count into the next,
// as the memory one does: max just before the edge refuses just after it,
// and the weight fades until a request fits again, when the refusal said.
// The window is 600ms: the test takes about a window and a half.
func TestRedisSlidingWindow(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	const window = 600 * time.Millisecond
	lim := Limit{Window: window, Max: 3, Algorithm: SlidingWindow}
	s.SetLimits([]Check{{Limit: lim}})
	start := time.Now()
	for i := range 3 {
		if v, err := s.Hit(bg, "k", time.Now(), lim); err != nil || !v.Allowed || v.Remaining != 2-i {
			t.Fatalf("hit %d: %+v, %v", i+1, v, err)
		}
	}
	if v, _ := s.Hit(bg, "k", time.Now(), lim); v.Allowed {
		t.Fatal("4th hit admitted in the first window")
	}
	// Listed with its window's end, not the key's (a window later).
	var states []KeyState
	s.Range(bg, time.Now(), func(ks KeyState) bool { states = append(states, ks); return true })
	if len(states) != 1 || time.Until(states[0].Reset) > window || states[0].Count != 3 {
		t.Fatalf("listing = %+v, want k with 3 in a window ending within %s", states, window)
	}
	// The window has ended once the count key has a window or less to
	// live (redis.lua).
	count := s.base("", "k") + "c"
	waitUntil(t, srv, start.Add(window), start.Add(window+window/2), "the first window did not end", func() bool {
		ttl, err := client.PTTL(bg, count).Result()
		return err == nil && ttl <= window
	})
	// Just into the next window the previous 3 weigh nearly 3: full.
	v, err := s.Hit(bg, "k", time.Now(), lim)
	if err != nil || v.Allowed || v.RetryAfter <= 0 || v.RetryAfter > window {
		t.Fatalf("just after the edge: %+v, %v; want refused with a wait under a window", v, err)
	}
	srv.Sleep(time.Until(time.Now().Add(v.RetryAfter + 50*time.Millisecond)))
	if v, err := s.Hit(bg, "k", time.Now(), lim); err != nil || !v.Allowed {
		t.Fatalf("after the wait it gave: %+v, %v; want admitted", v, err)
	}
	if v, _ := s.Hit(bg, "k", time.Now(), lim); v.Allowed {
		t.Fatalf("a second request right after: %+v, want refused (the previous window still weighs)", v)
	}
}
