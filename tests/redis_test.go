package tests

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// loadClient sends the concurrent requests of the Redis tests.
var loadClient = &http.Client{
	Timeout:   10 * time.Second,
	Transport: &http.Transport{MaxIdleConnsPerHost: 128, MaxConnsPerHost: 128},
}

// caddyBinary builds cmd/caddy once per test run, for the tests that need a
// second Caddy process (caddytest runs only one Caddy in-process). The
// binary goes to one temporary path per checkout, overwritten by each run,
// so that runs leave no binaries piling up.
var caddyBinary = sync.OnceValues(func() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256([]byte(wd))
	dir := filepath.Join(os.TempDir(), "caddy-rate-limit-tests-"+hex.EncodeToString(sum[:6]))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	bin := filepath.Join(dir, "caddy")
	out, err := exec.Command("go", "build", "-o", bin, "../cmd/caddy").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("go build ../cmd/caddy: %v\n%s", err, out)
	}
	return bin, nil
})

// startCaddyProcess runs the built Caddy binary with site (after the global
// options; "$PORT" stands for its HTTP port) and returns its base URL. It is
// stopped when the test ends.
func startCaddyProcess(t *testing.T, site string) string {
	t.Helper()
	port := freePort()
	cfg := fmt.Sprintf(globals, freePort(), port, freePort(), "") + strings.ReplaceAll(site, "$PORT", fmt.Sprint(port))
	return runCaddyProcess(t, cfg, port)
}

// runCaddyProcess runs the built Caddy binary with the whole Caddyfile cfg,
// waits until it listens on port and returns its base URL. It is stopped
// when the test ends.
func runCaddyProcess(t *testing.T, cfg string, port int) string {
	t.Helper()
	base, _ := runCaddyCmd(t, cfg, port)
	return base
}

// runCaddyCmd is runCaddyProcess that also returns the process, for tests
// that kill it.
func runCaddyCmd(t *testing.T, cfg string, port int) (string, *exec.Cmd) {
	t.Helper()
	bin, err := caddyBinary()
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(t.TempDir(), "Caddyfile")
	if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--config", file, "--adapter", "caddyfile")
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	deadline := time.Now().Add(15 * time.Second)
	for {
		conn, err := net.DialTimeout("tcp", addr, 100*time.Millisecond)
		if err == nil {
			conn.Close()
			return "http://" + addr, cmd
		}
		if time.Now().After(deadline) {
			t.Fatalf("caddy process did not listen on %s: %v", addr, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Two Caddy instances on one Redis, 64 concurrent clients spread over both,
// one key: exactly max requests are admitted in total, not one more.
func TestRedisTwoInstancesOneLimit(t *testing.T) {
	srv := redistest.Start(t)
	testTwoInstances(t, "redis_two", []string{srv.Addr})
}

// The same admission test on a three-master Redis Cluster.
func TestRedisClusterTwoInstancesOneLimit(t *testing.T) {
	testTwoInstances(t, "redis_cluster_two", redistest.StartCluster(t))
}

func testTwoInstances(t *testing.T, zone string, addrs []string) {
	const maxN, clients, perClient = 50, 64, 7 // 448 requests
	site := fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		window 60
		max %d
		key {http.request.header.X-Client}
		store redis {
			address %s
			timeout 2s
			on_error deny
		}
	}
	respond "ok"
}`, zone, maxN, strings.Join(addrs, " "))
	a := startCaddy(t, "", site)
	b := startCaddyProcess(t, site)
	bases := []string{a.Base, b}

	var statuses [600]atomic.Int64
	var perInstance [2]atomic.Int64
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range perClient {
				inst := (c + i) % 2
				req, _ := http.NewRequest(http.MethodGet, bases[inst]+"/", nil)
				req.Header.Set("X-Client", "one-key")
				resp, err := loadClient.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				statuses[resp.StatusCode].Add(1)
				if resp.StatusCode == http.StatusOK {
					perInstance[inst].Add(1)
				}
			}
		})
	}
	wg.Wait()
	ok, limited := statuses[http.StatusOK].Load(), statuses[http.StatusTooManyRequests].Load()
	if ok != maxN || limited != clients*perClient-maxN {
		t.Errorf("admitted %d, refused %d of %d requests; want exactly %d admitted across both instances (other statuses: 503=%d 500=%d)",
			ok, limited, clients*perClient, maxN, statuses[503].Load(), statuses[500].Load())
	}
	if perInstance[0].Load() == 0 || perInstance[1].Load() == 0 {
		t.Errorf("admitted per instance %d and %d: both should have served some", perInstance[0].Load(), perInstance[1].Load())
	}
}

// Kill Redis under load: each on_error mode does what it says, no request
// waits much longer than the timeout, nothing panics; once Redis is back the
// zones decide through it again by themselves.
func TestRedisKilledUnderLoad(t *testing.T) {
	srv := redistest.Start(t)
	const timeout = 100 * time.Millisecond
	zoneBlock := func(mode string) string {
		return fmt.Sprintf(`
	handle /%[1]s {
		rate_limit {
			zone redis_kill_%[1]s
			window 60
			max 5
			key {http.request.header.X-Client}
			store redis {
				address %[2]s
				timeout %[3]s
				on_error %[1]s
			}
		}
		respond "ok"
	}`, mode, srv.Addr, timeout)
	}
	s := startCaddy(t, "", ":$PORT {"+zoneBlock("allow")+zoneBlock("deny")+zoneBlock("local")+"\n}")
	modes := []string{"allow", "deny", "local"}

	type result struct {
		status  int
		elapsed time.Duration
		retry   string
	}
	do := func(mode, client string) result {
		req, _ := http.NewRequest(http.MethodGet, s.Base+"/"+mode, nil)
		req.Header.Set("X-Client", client)
		start := time.Now()
		resp, err := loadClient.Do(req)
		if err != nil {
			t.Errorf("%s: %v", mode, err)
			return result{}
		}
		resp.Body.Close()
		return result{resp.StatusCode, time.Since(start), resp.Header.Get("Retry-After")}
	}

	// Load: 24 clients, each its own key, cycling over the three zones.
	ctx, stopLoad := context.WithCancel(context.Background())
	var slowest, answered atomic.Int64
	var bad sync.Map // unexpected status → mode
	var wg sync.WaitGroup
	for c := range 24 {
		wg.Go(func() {
			for i := 0; ctx.Err() == nil; i++ {
				mode := modes[(c+i)%3]
				r := do(mode, fmt.Sprintf("load-%d-%d", c, i/30))
				answered.Add(1)
				for {
					old := slowest.Load()
					if int64(r.elapsed) <= old || slowest.CompareAndSwap(old, int64(r.elapsed)) {
						break
					}
				}
				switch {
				case r.status == http.StatusOK, r.status == http.StatusTooManyRequests:
				case r.status == http.StatusServiceUnavailable && mode == "deny":
				default:
					bad.Store(fmt.Sprintf("%s:%d", mode, r.status), true)
				}
			}
		})
	}
	// Redis dies under load, and the load goes on until every zone has
	// seen it fail (DEGRADED).
	if !eventuallyAcross(func() bool { return answered.Load() >= 100 }) {
		t.Fatalf("%d answers before redis was stopped, want 100", answered.Load())
	}
	srv.Stop()
	for _, mode := range modes {
		zone := "redis_kill_" + mode
		if !eventuallyAcross(func() bool { return zoneSummary(t, zone)["health"] == limiterDegraded }) {
			t.Fatalf("%s: health %v with redis down, want %s", zone, zoneSummary(t, zone)["health"], limiterDegraded)
		}
	}

	// With Redis down, fresh keys see each mode's behaviour.
	for i := 1; i <= 7; i++ {
		if r := do("allow", "down-a"); r.status != http.StatusOK {
			t.Errorf("allow, request %d with redis down: status %d, want 200", i, r.status)
		}
		r := do("deny", "down-d")
		if r.status != http.StatusServiceUnavailable || r.retry == "" {
			t.Errorf("deny, request %d with redis down: status %d, Retry-After %q; want 503 with Retry-After", i, r.status, r.retry)
		}
		want := http.StatusOK
		if i > 5 {
			want = http.StatusTooManyRequests
		}
		if r := do("local", "down-l"); r.status != want {
			t.Errorf("local, request %d with redis down: status %d, want %d (the local store keeps limiting)", i, r.status, want)
		}
	}
	stopLoad()
	wg.Wait()
	bad.Range(func(k, _ any) bool {
		t.Errorf("unexpected response under load: %s", k)
		return true
	})
	if d := time.Duration(slowest.Load()); d > timeout+400*time.Millisecond {
		t.Errorf("slowest request took %s, want at most the %s timeout plus slack", d, timeout)
	} else {
		t.Logf("slowest request while redis died: %s", d)
	}

	// Redis back: every zone decides through it again by itself, which
	// shows as its counter in Redis (and, for deny, as a 200).
	srv.Restart()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	deadline := time.Now().Add(10 * time.Second)
	for _, mode := range modes {
		for n := 0; ; n++ {
			key := fmt.Sprintf("back-%s-%d", mode, n)
			r := do(mode, key)
			counted := rdb.Exists(context.Background(), fmt.Sprintf("caddy_rate_limit:redis_kill_%s:{key:%s}:c", mode, key)).Val() == 1
			if counted && r.status == http.StatusOK {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: redis restarted 10s ago but the zone still does not decide through it (status %d, counted in redis %t)", mode, r.status, counted)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// Nothing connects at Provision: caddy adapt and caddy validate accept a
// Redis store whose server is not running.
func TestRedisValidateWithoutRedis(t *testing.T) {
	bin, err := caddyBinary()
	if err != nil {
		t.Fatal(err)
	}
	ln := redistest.Listen(t) // counts connections: there must be none
	file := filepath.Join(t.TempDir(), "Caddyfile")
	cfg := `{
	admin off
	auto_https off
}
:0 {
	rate_limit {
		zone redis_validate
		store redis {
			address ` + ln.Addr + `
			password {env.RL_TEST_UNSET_PASSWORD}
		}
	}
	respond "ok"
}`
	if err := os.WriteFile(file, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"adapt", "validate"} {
		start := time.Now()
		out, err := exec.Command(bin, cmd, "--config", file, "--adapter", "caddyfile").CombinedOutput()
		if err != nil {
			t.Errorf("caddy %s with no redis running: %v\n%s", cmd, err, out)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("caddy %s took %s", cmd, d)
		}
	}
	if n := ln.Accepted(); n != 0 {
		t.Errorf("caddy adapt and validate made %d connections to Redis, want none", n)
	}
}

// A reload that changes on_error keeps the zone's counts (they are in
// Redis and the zone is kept); the new mode applies at once.
func TestRedisReloadKeepsCounts(t *testing.T) {
	srv := redistest.Start(t)
	site := func(onError string) string {
		return fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone redis_reload
		window 60
		max 3
		store redis {
			address %s
			on_error %s
			timeout 5s
		}
	}
	respond "ok"
}`, srv.Addr, onError)
	}
	s := startCaddy(t, "", site("allow"))
	for i := 1; i <= 2; i++ {
		resp, _ := s.get("/")
		wantStatus(t, resp, http.StatusOK)
	}
	s.reload("", site("deny"))
	resp, _ := s.get("/")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	resp, _ = s.get("/")
	wantStatus(t, resp, http.StatusTooManyRequests)

	srv.Stop()
	resp, _ = s.get("/other-path-same-key")
	// Still refused: the key is known to be over its limit, no round trip.
	wantStatus(t, resp, http.StatusTooManyRequests)
}
