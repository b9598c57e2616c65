package tests

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// request sends a GET to base+path with headers (name, value pairs) and
// returns the response, its body read and closed.
func request(t *testing.T, base, path string, headers ...string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	resp.Body.Close()
	return resp
}

// count_status 401 on a login route: right passwords never count, the
// fourth wrong one in the window is refused, and then a right one is
// refused too. The wrong password is answered by the error directive (a
// handler error, rendered later) and the right one by respond.
func TestCountStatusLogin(t *testing.T) {
	zone := "e2e-login"
	s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	route /login {
		rate_limit {
			zone %s
			window 60
			max 3
			count_status 401 403
		}
		@right header X-Password secret
		respond @right "welcome" 200
		error "wrong password" 401
	}
}`, zone))
	login := func(password string) *http.Response {
		return request(t, s.Base, "/login", "X-Forwarded-For", "198.51.100.1", "X-Password", password)
	}
	for i := range 5 {
		resp := login("secret")
		wantStatus(t, resp, http.StatusOK)
		if got := resp.Header.Get("X-Ratelimit-Remaining"); got != "2" {
			// The request holds its unit while served: 2 left then.
			t.Fatalf("right password %d: remaining %q, want 2 (the unit held while served)", i+1, got)
		}
	}
	if got := listingOf(t, zone)["e2e-login/198.51.100.1"]; got != "" && got != "0 0" {
		t.Fatalf("after 5 right passwords the key is listed as %q (count refused), want nothing counted", got)
	}
	for i := range 3 {
		wantStatus(t, login("guess"+strconv.Itoa(i)), http.StatusUnauthorized)
	}
	wantListing(t, zone, map[string]string{"e2e-login/198.51.100.1": "3 0"})
	resp := login("guess4")
	wantStatus(t, resp, http.StatusTooManyRequests)
	if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra < 50 {
		t.Errorf("Retry-After = %q, want the rest of the minute", resp.Header.Get("Retry-After"))
	}
	wantStatus(t, login("secret"), http.StatusTooManyRequests)
	// Another client is not affected.
	wantStatus(t, request(t, s.Base, "/login", "X-Forwarded-For", "198.51.100.2", "X-Password", "secret"), http.StatusOK)
}

// Concurrent wrong passwords of one key never overshoot: each admitted
// request holds its unit while the (slow) backend answers, so 20 at once
// reach the backend 3 times, not 20.
func TestCountStatusConcurrent(t *testing.T) {
	var reached atomic.Int64
	release := make(chan struct{})
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		reached.Add(1)
		<-release // held until every request has its verdict
		w.WriteHeader(http.StatusUnauthorized)
	}))
	defer backend.Close()
	s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone e2e-login-concurrent
		window 60
		max 3
		count_status 4xx
	}
	reverse_proxy %s
}`, backend.Listener.Addr()))
	var wg sync.WaitGroup
	var statuses sync.Map
	var answered atomic.Int64
	for range 20 {
		wg.Go(func() {
			resp := request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.3")
			n, _ := statuses.LoadOrStore(resp.StatusCode, new(atomic.Int64))
			n.(*atomic.Int64).Add(1)
			answered.Add(1)
		})
	}
	// Every request but those the backend holds is answered while the
	// three hold their units.
	if !eventually(func() bool { return answered.Load()+reached.Load() >= 20 }) {
		t.Errorf("%d answered and %d at the backend, want 20 in all", answered.Load(), reached.Load())
	}
	close(release)
	wg.Wait()
	got := map[any]int64{}
	statuses.Range(func(k, v any) bool { got[k] = v.(*atomic.Int64).Load(); return true })
	if reached.Load() != 3 || got[http.StatusUnauthorized] != 3 || got[http.StatusTooManyRequests] != 17 {
		t.Fatalf("20 concurrent wrong passwords: backend reached %d times, statuses %v; want 3 reached, 3 401s and 17 429s", reached.Load(), got)
	}
}

// A ban outlives the window on two instances sharing Redis, is listed with
// banned_until, and one unblock lifts it on both.
func TestBanFleet(t *testing.T) {
	srv := redistest.Start(t)
	zone := "e2e-ban"
	site := fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		window 1
		max 1
		key {http.request.header.X-Client}
		ban 1m
		store redis {
			address %s
			timeout 5s
		}
	}
	respond "ok"
}`, zone, srv.Addr)
	a := startCaddy(t, "", site)
	b := startCaddyProcess(t, site)
	get := func(base string) *http.Response { return request(t, base, "/", "X-Client", "mallory") }
	wantStatus(t, get(a.Base), http.StatusOK)
	resp := get(b)
	wantStatus(t, resp, http.StatusTooManyRequests)
	if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra < 55 || ra > 60 {
		t.Fatalf("Retry-After of the first refusal = %q, want the 1m ban", resp.Header.Get("Retry-After"))
	}
	if reset, _ := strconv.ParseInt(resp.Header.Get("X-Ratelimit-Reset"), 10, 64); reset < time.Now().Unix()+55 {
		t.Errorf("X-RateLimit-Reset = %d, want the ban's end, a minute from now", reset)
	}
	waitWindowOver(t, zone, zone+"/key:mallory") // the window is over; the ban is not
	for _, base := range []string{a.Base, b} {
		resp := get(base)
		wantStatus(t, resp, http.StatusTooManyRequests)
		if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra < 50 {
			t.Fatalf("%s after the window: Retry-After %q, want the rest of the ban", base, resp.Header.Get("Retry-After"))
		}
	}
	var list keyList
	adminJSON(t, "/rate_limit/"+zone, &list)
	if len(list.Keys) != 1 || list.Keys[0].Key != "key:mallory" || list.Keys[0].BannedUntil < time.Now().Unix()+50 || !list.Keys[0].Limited {
		t.Fatalf("listing = %+v, want key:mallory banned for about a minute", list.Keys)
	}
	if status, body := admin(t, http.MethodDelete, "/rate_limit/"+zone+"?key=key:mallory"); status != http.StatusOK {
		t.Fatalf("unblock: %d %s", status, body)
	}
	start := time.Now()
	for _, base := range []string{b, a.Base} {
		for get(base).StatusCode != http.StatusOK {
			if time.Since(start) > time.Second {
				t.Fatalf("%s still refuses the key a second after the unblock", base)
			}
			time.Sleep(50 * time.Millisecond)
		}
		// Admitted once: the next request goes over again and is banned
		// anew, so unblock again for the other instance.
		admin(t, http.MethodDelete, "/rate_limit/"+zone+"?key=key:mallory")
	}
}

// cost spends the quota in steps; handlers of one zone may charge
// different costs, and a cost placeholder with a bad value costs 1.
func TestCost(t *testing.T) {
	zone := "e2e-cost"
	s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	handle /export {
		rate_limit {
			zone %[1]s
			window 60
			max 25
			cost 10
		}
		respond "export"
	}
	handle /weighed {
		rate_limit {
			zone %[1]s
			window 60
			max 25
			cost {http.request.header.X-Cost}
		}
		respond "weighed"
	}
	handle {
		rate_limit {
			zone %[1]s
			window 60
			max 25
		}
		respond "ok"
	}
}`, zone))
	get := func(path string, headers ...string) *http.Response {
		return request(t, s.Base, path, append([]string{"X-Forwarded-For", "198.51.100.4"}, headers...)...)
	}
	for _, step := range []struct {
		path, cost string
		status     int
		remaining  string
	}{
		{"/export", "", 200, "15"},
		{"/export", "", 200, "5"},
		{"/export", "", 429, "5"}, // 10 more than the 5 left: refused, spends nothing
		{"/", "", 200, "4"},
		{"/weighed", "3", 200, "1"},
		{"/weighed", "not-a-number", 200, "0"}, // costs 1
		{"/", "", 429, "0"},
	} {
		var h []string
		if step.cost != "" {
			h = []string{"X-Cost", step.cost}
		}
		resp := get(step.path, h...)
		if resp.StatusCode != step.status || resp.Header.Get("X-Ratelimit-Remaining") != step.remaining {
			t.Fatalf("%s (cost %q): %d with %q left, want %d with %s left", step.path, step.cost, resp.StatusCode, resp.Header.Get("X-Ratelimit-Remaining"), step.status, step.remaining)
		}
	}
}

// gcra admits its burst, then one request per interval.
func TestGCRA(t *testing.T) {
	clk := fakeClock(t, "e2e-gcra")
	s := startCaddy(t, trustLoopback, `
:$PORT {
	rate_limit {
		zone e2e-gcra
		algorithm gcra
		window 1
		max 5
		burst 3
	}
	respond "ok"
}`)
	get := func() *http.Response { return request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.5") }
	for i, want := range []string{"2", "1", "0"} {
		resp := get()
		if resp.StatusCode != http.StatusOK || resp.Header.Get("X-Ratelimit-Remaining") != want {
			t.Fatalf("burst request %d: %d with %q left, want 200 with %s", i+1, resp.StatusCode, resp.Header.Get("X-Ratelimit-Remaining"), want)
		}
	}
	resp := get()
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "Retry-After", "1") // 200ms, rounded up
	clk.Advance(200 * time.Millisecond)     // one interval (1s / 5)
	wantStatus(t, get(), http.StatusOK)
	wantStatus(t, get(), http.StatusTooManyRequests)
}

// delay turns a would-be 429 into a late 200; a key waits at most
// delay_per_key requests at once; a client that goes away while waiting
// spends nothing. The zone's clock is the test's: a request waits until
// the test moves it.
func TestDelay(t *testing.T) {
	clk := fakeClock(t, "e2e-delay")
	s := startCaddy(t, trustLoopback, `
:$PORT {
	rate_limit {
		zone e2e-delay
		window 1
		max 1
		delay 2s
		delay_per_key 1
	}
	respond "ok"
}`)
	get := func(c *http.Client) (*http.Response, error) {
		req, _ := http.NewRequest(http.MethodGet, s.Base+"/", nil)
		req.Header.Set("X-Forwarded-For", "198.51.100.6")
		resp, err := c.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return resp, err
	}
	// waiting reports whether a request waits for the window's end.
	waiting := func() bool { return clk.Pending(2*time.Second) > 0 }
	resp, _ := get(client)
	wantStatus(t, resp, http.StatusOK)
	var wg sync.WaitGroup
	var late *http.Response
	var lateErr error
	wg.Go(func() { late, lateErr = get(client) })
	if !eventually(waiting) {
		t.Fatal("the second request does not wait")
	}
	// The key's one waiting place is taken: refused at once.
	resp, err := get(client)
	if err != nil || resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("second waiting request: %v %v, want a 429 at once", resp, err)
	}
	// The window ends (and the moment the wait adds to it passes): the
	// waiting request goes through.
	clk.Advance(1100 * time.Millisecond)
	wg.Wait()
	if lateErr != nil || late.StatusCode != http.StatusOK {
		t.Fatalf("delayed request: %v %v, want a late 200", late, lateErr)
	}
	m := scrape(t, "e2e-delay")
	if m[series("requests_total", "e2e-delay", "delayed")] != 1 || m[series("requests_total", "e2e-delay", "limited")] != 1 {
		t.Errorf("metrics = %v, want 1 delayed and 1 limited", m)
	}
	// A client that gives up while waiting spends nothing: the next window
	// is whole for the request after it.
	clk.Advance(1100 * time.Millisecond) // the late request's window ends
	resp, _ = get(client)
	wantStatus(t, resp, http.StatusOK)
	impatient := &http.Client{Timeout: 200 * time.Millisecond}
	if _, err := get(impatient); err == nil {
		t.Fatal("the impatient client got an answer while the window was spent")
	}
	if !eventually(func() bool { return !waiting() }) {
		t.Fatal("the impatient client's request still waits after it went away")
	}
	clk.Advance(1100 * time.Millisecond)
	resp, _ = get(client)
	wantStatus(t, resp, http.StatusOK) // the impatient one spent nothing
}

// Each limit may count its own statuses, on a Redis zone too: failures
// count in the login limit, every request in the daily one.
func TestCountStatusPerLimitRedis(t *testing.T) {
	srv := redistest.Start(t)
	zone := "e2e-login-limits"
	s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	route /login {
		rate_limit {
			zone %s
			window 60
			max 2
			count_status 401
			limit daily 5 1d {
				count_status all
			}
			store redis {
				address %s
				timeout 5s
			}
		}
		@right header X-Password secret
		respond @right "welcome" 200
		respond "wrong password" 401
	}
}`, zone, srv.Addr))
	login := func(password string) int {
		return request(t, s.Base, "/login", "X-Forwarded-For", "198.51.100.7", "X-Password", password).StatusCode
	}
	got := []int{login("secret"), login("secret"), login("wrong"), login("wrong"), login("secret")}
	want := []int{200, 200, 401, 401, 429}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("statuses = %v, want %v (the login limit counts the 2 failures and refuses)", got, want)
		}
	}
	wantListing(t, zone, map[string]string{
		zone + "/198.51.100.7": "2 1", // the failures only
		"daily/198.51.100.7":   "4 0", // every admitted request
	})
}
