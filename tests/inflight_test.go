package tests

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// slowBackend is an upstream whose requests wait until the test lets
// each go (release), or until their client goes away.
type slowBackend struct {
	addr    string
	flying  atomic.Int64 // requests waiting now
	seen    atomic.Int64 // requests that arrived
	release chan struct{}
}

// startSlowBackend listens on a port of its own (no Caddy shares it) until
// the test ends. A request to /fail has its connection cut once released.
func startSlowBackend(t *testing.T) *slowBackend {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &slowBackend{addr: l.Addr().String(), release: make(chan struct{})}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b.seen.Add(1)
		b.flying.Add(1)
		defer b.flying.Add(-1)
		select {
		case <-b.release:
		case <-r.Context().Done():
			return
		}
		if r.URL.Path == "/fail" {
			panic(http.ErrAbortHandler) // the upstream drops the connection
		}
		io.WriteString(w, "done")
	})}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	return b
}

// inFlightSite caps each X-Client's requests in flight at 3 in front of
// backend, and says in a refusal's body whether that cap refused it.
func inFlightSite(zone, backend string) string {
	return fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		key {http.request.header.X-Client}
		window 60
		max 1000
		max_in_flight 3
	}
	reverse_proxy %s
	handle_errors 429 {
		respond "in_flight={http.rate_limit.in_flight} violated={http.rate_limit.violated}" 429
	}
}`, zone, backend)
}

// inFlightOf returns the key's requests in flight as the listing shows
// them.
func inFlightOf(t *testing.T, zone, key string) int {
	t.Helper()
	var list struct {
		Keys []struct {
			Key      string `json:"key"`
			InFlight int    `json:"in_flight"`
		} `json:"keys"`
	}
	adminJSON(t, "/rate_limit/"+zone, &list)
	for _, k := range list.Keys {
		if k.Key == key {
			return k.InFlight
		}
	}
	return 0
}

// A key capped at 3 requests in flight, 10 at once in front of a slow
// backend: 3 reach it and 7 are refused with Retry-After: 1, saying the
// cap refused them; when one ends the next is admitted; slots come back
// when a client goes away, when the upstream fails and across a reload;
// once traffic stops the listing and the gauge read 0.
func TestMaxInFlightEndToEnd(t *testing.T) {
	zone := fresh("e2e-in-flight")
	backend := startSlowBackend(t)
	s := startCaddy(t, "", inFlightSite(zone, backend.addr))
	type answer struct {
		status      int
		retry, body string
	}
	send := func(ctx context.Context, path string) answer {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.Base+path, nil)
		req.Header.Set("X-Client", "c1")
		resp, err := loadClient.Do(req)
		if err != nil {
			return answer{status: -1, body: err.Error()}
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return answer{resp.StatusCode, resp.Header.Get("Retry-After"), string(body)}
	}
	var wg sync.WaitGroup
	answers := make(chan answer, 10)
	for range 10 {
		wg.Go(func() { answers <- send(context.Background(), "/") })
	}
	refused := 0
	for refused < 7 {
		select {
		case a := <-answers:
			if a.status != http.StatusTooManyRequests || a.retry != "1" || a.body != "in_flight=true violated="+zone {
				t.Fatalf("an answer before any request ended: %+v, want 429 for the requests in flight", a)
			}
			refused++
		case <-time.After(10 * time.Second):
			t.Fatalf("%d refused after 10s, want 7", refused)
		}
	}
	if !eventually(func() bool { return backend.flying.Load() == 3 }) {
		t.Fatalf("%d requests reached the backend, want 3", backend.flying.Load())
	}
	if n := inFlightOf(t, zone, "key:c1"); n != 3 {
		t.Errorf("listed in flight: %d, want 3", n)
	}
	if got := scrape(t, zone)[`caddy_rate_limit_requests_in_flight{zone="`+zone+`"}`]; got != 3 {
		t.Errorf("gauge of requests in flight: %v, want 3", got)
	}
	// One ends: the next is admitted.
	backend.release <- struct{}{}
	if a := <-answers; a.status != http.StatusOK {
		t.Fatalf("the released request: %+v, want 200", a)
	}
	wg.Go(func() { answers <- send(context.Background(), "/") })
	if !eventually(func() bool { return backend.flying.Load() == 3 }) {
		t.Fatalf("the next request did not reach the backend: %d there", backend.flying.Load())
	}
	// A client goes away: its slot comes back.
	ctx, cancel := context.WithCancel(context.Background())
	backend.release <- struct{}{}
	<-answers
	wg.Go(func() { answers <- send(ctx, "/") })
	if !eventually(func() bool { return backend.flying.Load() == 3 }) {
		t.Fatal("the request to abandon did not reach the backend")
	}
	cancel()
	<-answers
	if !eventually(func() bool { return inFlightOf(t, zone, "key:c1") == 2 }) {
		t.Fatalf("in flight after a client left: %d, want 2", inFlightOf(t, zone, "key:c1"))
	}
	// The upstream fails: its slot comes back too.
	wg.Go(func() { answers <- send(context.Background(), "/fail") })
	if !eventually(func() bool { return backend.flying.Load() == 3 }) {
		t.Fatal("the failing request did not reach the backend")
	}
	// A reload while 3 are in flight: the old config's requests give
	// their slots back when they end, and the new config counts them.
	s.reload("", inFlightSite(zone, backend.addr))
	if got := send(context.Background(), "/"); got.status != http.StatusTooManyRequests {
		t.Errorf("a fourth after the reload: %+v, want 429: the 3 in flight still count", got)
	}
	for range 3 {
		backend.release <- struct{}{}
	}
	for range 3 {
		<-answers
	}
	wg.Wait()
	if !eventually(func() bool { return inFlightOf(t, zone, "key:c1") == 0 }) {
		t.Errorf("in flight once traffic stopped: %d, want 0", inFlightOf(t, zone, "key:c1"))
	}
	if got := scrape(t, zone)[`caddy_rate_limit_requests_in_flight{zone="`+zone+`"}`]; got != 0 {
		t.Errorf("gauge once traffic stopped: %v, want 0", got)
	}
	if got := scrape(t, zone)[`caddy_rate_limit_requests_total{result="in_flight",zone="`+zone+`"}`]; got != 8 {
		t.Errorf("requests refused for the requests in flight: %v, want 8 (7, and 1 after the reload)", got)
	}
}

// Two instances on one Redis, exact and sync, share the cap: 3 in flight
// in all, not 3 each; a slot one frees the other can take at once; an
// instance killed with SIGKILL while holding slots frees them within the
// lease time (ws_lease_ttl).
func TestFleetMaxInFlight(t *testing.T) {
	srv := redistest.Start(t)
	for _, mode := range []struct{ name, store string }{{"exact", ""}, {"sync", "sync 100ms"}} {
		t.Run(mode.name, func(t *testing.T) { testFleetMaxInFlight(t, srv, mode.name, mode.store) })
	}
}

// testFleetMaxInFlight is TestFleetMaxInFlight on srv, with more of the
// store's options (a line, or "").
func testFleetMaxInFlight(t *testing.T, srv *redistest.Server, mode, more string) {
	backend := startSlowBackend(t)
	zone := fresh("e2e-fleet-in-flight-" + mode)
	site := strings.Replace(inFlightSite(zone, backend.addr), "max_in_flight 3", "max_in_flight 3\n\t\tws_lease_ttl 3s\n\t\tstore redis {\n\t\t\taddress "+srv.Addr+"\n\t\t\t"+more+"\n\t\t}", 1)
	a := startCaddy(t, "", site)
	port := freePort()
	b, cmd := runCaddyCmd(t, fmt.Sprintf(globals, freePort(), port, freePort(), "")+strings.ReplaceAll(site, "$PORT", fmt.Sprint(port)), port)
	send := func(base string) int { return statusOf(t, base, "X-Client", "c1") }
	for range 3 {
		go send(b)
	}
	if !eventuallyAcross(func() bool { return backend.flying.Load() == 3 }) {
		t.Fatalf("%d requests through the other instance reached the backend, want 3", backend.flying.Load())
	}
	if got := send(a.Base); got != http.StatusTooManyRequests {
		t.Fatalf("a fourth, through this instance: %d, want 429: the cap is the fleet's", got)
	}
	// One of the other instance's ends: its slot is free for this one at
	// once (given back off the response's path).
	backend.release <- struct{}{}
	freed := time.Now()
	go func() {
		for send(a.Base) == http.StatusTooManyRequests {
			time.Sleep(5 * time.Millisecond)
		}
	}()
	if !eventually(func() bool { return backend.seen.Load() == 4 }) {
		t.Fatal("the freed slot was never taken through this instance")
	}
	t.Logf("a slot freed on one instance was taken through the other %s later", time.Since(freed).Round(time.Millisecond))
	// The other instance dies holding 2 slots: they lapse.
	killed := time.Now()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for backend.seen.Load() == 4 {
		if time.Since(killed) > 10*time.Second {
			t.Fatal("the dead instance's slots never lapsed")
		}
		go send(a.Base) // admitted: it waits at the backend
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("a slot was free %s after the instance holding two was killed (lease time 3s)", time.Since(killed).Round(100*time.Millisecond))
	if d := time.Since(killed); d > 6*time.Second {
		t.Errorf("slots freed %s after the kill, want within the 3s lease and the polling's slack", d)
	}
	close(backend.release)
}
