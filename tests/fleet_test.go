package tests

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// A key refused on two instances sharing one Redis, unblocked through one
// instance's admin API, is admitted by the other within a second, though the
// other had cached its refusal for the rest of the minute.
func TestFleetUnblockEverywhere(t *testing.T) {
	srv := redistest.Start(t)
	site := fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone e2e-fleet-unblock
		window 60
		max 1
		key {http.request.header.X-Client}
		store redis {
			address %s
			timeout 5s
		}
	}
	respond "ok"
}`, srv.Addr)
	a := startCaddy(t, "", site)
	b := startCaddyProcess(t, site)
	get := func(base string) int {
		req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
		req.Header.Set("X-Client", "banned")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := get(a.Base); got != http.StatusOK {
		t.Fatalf("first request: %d", got)
	}
	for _, base := range []string{a.Base, b, b, a.Base} {
		if got := get(base); got != http.StatusTooManyRequests {
			t.Fatalf("%s: %d, want 429", base, got)
		}
	}
	if status, body := admin(t, http.MethodDelete, "/rate_limit/e2e-fleet-unblock?key=key:banned"); status != http.StatusOK {
		t.Fatalf("unblock: %d %s", status, body)
	}
	took := within(t, time.Second, "the other instance admits the unblocked key", func() bool { return get(b) == http.StatusOK })
	t.Logf("the other instance admitted the key %s after the unblock", took.Round(time.Millisecond))
}

// The socket cap of a Redis zone counts across the fleet: with a cap of 2,
// two sockets through instance P leave none for instance I (close 1013);
// closing one on P lets I open one; killing P with SIGKILL frees its other
// socket's lease within ws_lease_ttl.
func TestFleetSocketCap(t *testing.T) {
	srv := redistest.Start(t)
	backend := startEchoBackend(t)
	site := wsSite(backend, fmt.Sprintf(`zone e2e-fleet-ws
		max 100
		ws_max_connections_per_ip 2
		ws_lease_ttl 3s
		store redis {
			address %s
			timeout 5s
		}`, srv.Addr), "")
	in := startCaddy(t, "", site)
	port := freePort()
	cfg := fmt.Sprintf(globals, freePort(), port, freePort(), "") + strings.ReplaceAll(site, "$PORT", fmt.Sprint(port))
	base, proc := runCaddyCmd(t, cfg, port)
	p := &server{t: t, Base: base}

	c1, _ := p.mustDialWS("/")
	wantEcho(t, c1, "one")
	c2, _ := p.mustDialWS("/")
	wantEcho(t, c2, "two")
	in.wantTryAgainLater("/", nil)

	c1.Close(websocket.StatusNormalClosure, "done")
	var c3 *websocket.Conn
	deadline := time.Now().Add(5 * time.Second)
	for c3 == nil {
		c, _, err := in.dialWS("/", nil)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			err = c.Write(ctx, websocket.MessageText, []byte("three"))
			if err == nil {
				_, msg, rerr := c.Read(ctx)
				if rerr == nil && string(msg) == "three" {
					c3 = c
				}
			}
			cancel()
			if c3 == nil {
				c.CloseNow()
			}
		}
		if c3 == nil && time.Now().After(deadline) {
			t.Fatal("instance I could not open a socket after P closed one")
		}
		if c3 == nil {
			time.Sleep(100 * time.Millisecond)
		}
	}
	defer c3.CloseNow()
	in.wantTryAgainLater("/", nil) // P's second socket and I's one: full

	// P dies without giving back its lease; it lapses within ws_lease_ttl.
	killed := time.Now()
	if err := proc.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for {
		c, _, err := in.dialWS("/", nil)
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			werr := c.Write(ctx, websocket.MessageText, []byte("four"))
			_, msg, rerr := c.Read(ctx)
			cancel()
			c.CloseNow()
			if werr == nil && rerr == nil && string(msg) == "four" {
				t.Logf("the killed instance's lease lapsed %s after SIGKILL", time.Since(killed).Round(100*time.Millisecond))
				break
			}
		}
		if time.Since(killed) > 5*time.Second {
			t.Fatal("the killed instance's lease still counts 5 s after SIGKILL (ws_lease_ttl 3s)")
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// A Sentinel failover under traffic: the master dies, decisions keep
// flowing (on_error local decides while Redis cannot), the zone reports
// its health going down and back, and once the Sentinel has promoted the
// replica the decisions go to the new master.
func TestSentinelFailover(t *testing.T) {
	sn := redistest.StartSentinel(t)
	const zone = "e2e-sentinel"
	s := startCaddy(t, "", fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		window 60
		max 1000000
		key {http.request.header.X-Client}
		store redis {
			address %s
			master_name %s
			timeout 200ms
			on_error local
		}
	}
	respond "ok"
}`, zone, sn.Addr, redistest.SentinelMaster))

	var mu sync.Mutex
	statuses := map[int]int{}
	healths := []string{}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(20 * time.Millisecond):
			}
			req, _ := http.NewRequest(http.MethodGet, s.Base+"/", nil)
			req.Header.Set("X-Client", fmt.Sprintf("c%d", i%10))
			resp, err := client.Do(req)
			mu.Lock()
			if err != nil {
				statuses[-1]++
			} else {
				statuses[resp.StatusCode]++
				resp.Body.Close()
			}
			mu.Unlock()
		}
	})
	health := func() string {
		h, _ := zoneSummary(t, zone)["health"].(string)
		mu.Lock()
		if len(healths) == 0 || healths[len(healths)-1] != h {
			healths = append(healths, h)
		}
		mu.Unlock()
		return h
	}
	// The traffic flows before the master dies.
	if !eventuallyAcross(func() bool { mu.Lock(); defer mu.Unlock(); return statuses[http.StatusOK] >= 10 }) {
		t.Fatalf("before the failover: statuses %v, want 10 answered", statuses)
	}
	if h := health(); h != limiterHealthy {
		t.Fatalf("before the failover: health %q", h)
	}

	sn.Master.Stop()
	killed := time.Now()
	sawDown := false
	for {
		h := health()
		sawDown = sawDown || h != limiterHealthy
		if sawDown && h == limiterHealthy {
			break
		}
		if time.Since(killed) > 30*time.Second {
			t.Fatalf("no failover within 30 s: health went %v", healths)
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("healthy again %s after the master died (health %v)", time.Since(killed).Round(100*time.Millisecond), healths)

	// Decisions now go to the promoted replica.
	rc := redis.NewClient(&redis.Options{Addr: sn.Replica.Addr})
	defer rc.Close()
	key := "caddy_rate_limit:" + zone + ":{key:c0}:c"
	before, _ := rc.Get(context.Background(), key).Int()
	after := before
	eventuallyAcross(func() bool { after, _ = rc.Get(context.Background(), key).Int(); return after > before })
	close(stop)
	wg.Wait()
	info, _ := rc.Info(context.Background(), "replication").Result()
	if !strings.Contains(info, "role:master") || after <= before {
		t.Errorf("the promoted replica: %q, count of c0 %d then %d; want a master counting the traffic", strings.SplitN(info, "\n", 3)[1], before, after)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(statuses) != 1 || statuses[http.StatusOK] == 0 {
		t.Errorf("answers during the failover: %v, want only 200s", statuses)
	}
}

// The health a zone reports while Redis answers, and after it failed
// repeatedly.
const (
	limiterHealthy  = "HEALTHY"
	limiterDegraded = "DEGRADED"
)
