package tests

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// The abuse controls under clients that try to steer them: leaving before
// the answer, holding a request open, dry runs, shared buckets. Each runs
// on the memory store and on a real redis-server, in exact and in sync mode.

// e2eTimeout is a Redis store's timeout in tests that do not test it: the
// 100ms default fails decisions on a loaded host.
const e2eTimeout = "timeout 5s"

// forEachStore runs fn with the store block of each store ("" for memory).
func forEachStore(t *testing.T, fn func(t *testing.T, name, store string)) {
	t.Run("memory", func(t *testing.T) { fn(t, "memory", "") })
	t.Run("redis", func(t *testing.T) {
		srv := redistest.Start(t)
		fn(t, "redis", fmt.Sprintf("store redis {\n\t\t\taddress %s\n\t\t\t%s\n\t\t}", srv.Addr, e2eTimeout))
	})
	t.Run("redis sync", func(t *testing.T) {
		srv := redistest.Start(t)
		clearOfMinuteEdge(t)
		fn(t, "redis-sync", fmt.Sprintf("store redis {\n\t\t\taddress %s\n\t\t\tsync 100ms\n\t\t\t%s\n\t\t}", srv.Addr, e2eTimeout))
	})
}

// clearOfMinuteEdge returns once at least 20 s are left before the next
// minute starts. Sync mode's windows are aligned to the clock, so a
// window of 60 s ends at every minute: a test that crossed one would see
// its counts start afresh halfway (the memory and exact stores start a
// window at its first request). The tests that run on every store take a
// few seconds.
func clearOfMinuteEdge(t *testing.T) {
	t.Helper()
	const room = 20 * time.Second
	if left := time.Until(time.Now().Truncate(time.Minute).Add(time.Minute)); left < room {
		t.Logf("waiting %v for the next minute's window", left.Round(time.Millisecond))
		time.Sleep(left)
	}
}

// awaitSync waits, for a zone in sync mode, until its last decisions have
// reached Redis, where its listing reads them: until two more rounds have
// gone out (the first may have started before them).
func awaitSync(t *testing.T, name, zone string) {
	t.Helper()
	if name != "redis-sync" {
		return
	}
	rounds := series("sync_round_trips_total", zone, "")
	from := scrape(t, zone)[rounds]
	if !eventuallyAcross(func() bool { return scrape(t, zone)[rounds] >= from+2 }) {
		t.Fatalf("zone %s: no two sync rounds after %v", zone, from)
	}
}

// bannedUntil returns the banned_until of key in limit policy of zone's
// listing (0: not banned, or not listed).
func bannedUntil(t *testing.T, zone, policy, key string) int64 {
	t.Helper()
	var list keyList
	adminJSON(t, "/rate_limit/"+zone+"?limit=1000", &list)
	for _, k := range list.Keys {
		if k.Policy == policy && k.Key == key {
			return k.BannedUntil
		}
	}
	return 0
}

// A client that gives up before its slow 401 spends its unit all the same:
// the status written after it left (reverse_proxy's 499) counts, so the
// fourth attempt is refused and the backend sees three. A 200 written while
// the client was there gives the unit back, even if the client then leaves
// mid-body.
func TestCountStatusAbandonedCounts(t *testing.T) {
	forEachStore(t, func(t *testing.T, name, store string) {
		var reached, done atomic.Int64
		backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			reached.Add(1)
			defer done.Add(1)
			if r.URL.Path == "/stream" {
				// The status first, then a slow body.
				w.WriteHeader(http.StatusOK)
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
				case <-time.After(300 * time.Millisecond):
				}
				io.WriteString(w, "late body")
				return
			}
			select {
			case <-r.Context().Done():
			case <-time.After(300 * time.Millisecond):
			}
			w.WriteHeader(http.StatusUnauthorized)
		}))
		defer backend.Close()
		zone := "e2e-abandon-" + name
		s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		window 60
		max 3
		count_status 401 403
		%s
	}
	reverse_proxy %s
}`, zone, store, backend.Listener.Addr()))
		impatient := &http.Client{Timeout: 100 * time.Millisecond}
		attempt := func(ip, path string) (int, error) {
			req, _ := http.NewRequest(http.MethodGet, s.Base+path, nil)
			req.Header.Set("X-Forwarded-For", ip)
			resp, err := impatient.Do(req)
			if err != nil {
				return 0, err
			}
			resp.Body.Close() // before the body: the client leaves mid-body
			return resp.StatusCode, nil
		}
		var statuses []string
		for range 6 {
			code, err := attempt("198.51.100.60", "/")
			if err != nil {
				statuses = append(statuses, "gave up")
			} else {
				statuses = append(statuses, strconv.Itoa(code))
			}
		}
		want := "[gave up gave up gave up 429 429 429]"
		if got := fmt.Sprint(statuses); got != want {
			t.Fatalf("six impatient attempts: %s, want %s", got, want)
		}
		if !eventually(func() bool { return done.Load() == 3 }) {
			t.Fatalf("backend finished %d requests, want 3", done.Load())
		}
		// Settled a moment after the backend: what the abandoned requests
		// spent stays spent.
		awaitSync(t, name, zone)
		for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
			if got := listingOf(t, zone)[zone+"/198.51.100.60"]; got != "3 3" {
				t.Fatalf("listing %q, want count 3 and 3 refused (nothing given back)", got)
			}
		}
		resp := request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.60")
		wantStatus(t, resp, http.StatusTooManyRequests)
		if reached.Load() != 3 {
			t.Fatalf("backend reached %d times, want 3", reached.Load())
		}

		// A 200 that the client saw (then left mid-body) gives back.
		reached.Store(0)
		done.Store(0)
		for i := range 4 {
			if code, err := attempt("198.51.100.61", "/stream"); err != nil || code != http.StatusOK {
				t.Fatalf("streamed request %d: %d, %v; want 200", i+1, code, err)
			}
			if !eventually(func() bool { return done.Load() == int64(i+1) }) {
				t.Fatalf("backend finished %d streamed requests, want %d", done.Load(), i+1)
			}
			if !eventuallyAcross(func() bool { l := listingOf(t, zone)[zone+"/198.51.100.61"]; return l == "" || l == "0 0" }) {
				t.Fatalf("after streamed request %d the key is listed as %q, want its unit given back", i+1, listingOf(t, zone)[zone+"/198.51.100.61"])
			}
		}
	})
}

// A request held open does not keep a refusal from banning: the refusal is
// a pending violation, which stands once the held request settles counted
// (the ban runs from then) and lapses when it settles uncounted.
func TestBanWaitsForRequestsInFlight(t *testing.T) {
	forEachStore(t, func(t *testing.T, name, store string) {
		release := make(chan struct{})
		arrived := make(chan struct{}, 1)
		backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/slow" {
				arrived <- struct{}{}
				<-release
			}
			status, _ := strconv.Atoi(r.URL.Query().Get("status"))
			w.WriteHeader(status)
		}))
		defer backend.Close()
		zone := "e2e-ban-held-" + name
		s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		window 60
		max 3
		count_status 401
		ban 10m
		%s
	}
	reverse_proxy %s
}`, zone, store, backend.Listener.Addr()))
		for _, tc := range []struct {
			ip     string
			status int  // of the held request
			banned bool // once it settles
		}{
			{"198.51.100.70", http.StatusUnauthorized, true},
			{"198.51.100.71", http.StatusOK, false},
		} {
			get := func(path string) *http.Response {
				return request(t, s.Base, path, "X-Forwarded-For", tc.ip)
			}
			for range 2 {
				wantStatus(t, get("/fast?status=401"), http.StatusUnauthorized)
			}
			held := make(chan int)
			go func() {
				req, _ := http.NewRequest(http.MethodGet, s.Base+"/slow?status="+strconv.Itoa(tc.status), nil)
				req.Header.Set("X-Forwarded-For", tc.ip)
				resp, err := client.Do(req)
				if err != nil {
					held <- 0
					return
				}
				resp.Body.Close()
				held <- resp.StatusCode
			}()
			<-arrived
			// The held request holds the third unit: refused, not banned yet.
			for range 3 {
				resp := get("/fast?status=401")
				wantStatus(t, resp, http.StatusTooManyRequests)
				if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra > 60 {
					t.Fatalf("%s: refusal while a request is held: Retry-After %d, want the window's (no ban yet)", tc.ip, ra)
				}
			}
			awaitSync(t, name, zone)
			if b := bannedUntil(t, zone, zone, tc.ip); b != 0 {
				t.Fatalf("%s: banned until %d while its request is held, want no ban yet", tc.ip, b)
			}
			release <- struct{}{}
			if got := <-held; got != tc.status {
				t.Fatalf("%s: held request answered %d, want %d", tc.ip, got, tc.status)
			}
			if tc.banned {
				if !eventuallyAcross(func() bool { return bannedUntil(t, zone, zone, tc.ip) > time.Now().Unix()+500 }) {
					t.Fatalf("%s: listed banned until %d once the held 401 settled, want about 10 minutes from now", tc.ip, bannedUntil(t, zone, zone, tc.ip))
				}
				resp := get("/fast?status=401")
				wantStatus(t, resp, http.StatusTooManyRequests)
				if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra < 500 {
					t.Fatalf("%s: after the ban started: Retry-After %d, want about 600", tc.ip, ra)
				}
				continue
			}
			// Given back: two counted, the violation lapsed.
			if !eventuallyAcross(func() bool { return listingOf(t, zone)[zone+"/"+tc.ip] == "2 3" }) {
				t.Fatalf("%s: listed %q once the held 200 settled, want 2 counted and 3 refused", tc.ip, listingOf(t, zone)[zone+"/"+tc.ip])
			}
			awaitSync(t, name, zone)
			if b := bannedUntil(t, zone, zone, tc.ip); b != 0 {
				t.Fatalf("%s: banned until %d after the held request gave its unit back, want no ban", tc.ip, b)
			}
			wantStatus(t, get("/fast?status=401"), http.StatusUnauthorized)
		}
	})
}

// A dry run bans no one, in the store or in the listing: it logs and
// counts the ban it would have started. Its counts carry over a reload.
func TestDryRunWritesNoBan(t *testing.T) {
	forEachStore(t, func(t *testing.T, name, store string) {
		zone := "e2e-dry-ban-" + name
		site := `
:$PORT {
	rate_limit {
		zone %s
		window 60
		max 2
		ban 10m escalate 1h
		%s
		%s
	}
	respond "ok"
}`
		s := startCaddy(t, trustLoopback, fmt.Sprintf(site, zone, "dry_run", store))
		for i := range 5 {
			resp := request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.80")
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("dry-run request %d: %d, want 200", i+1, resp.StatusCode)
			}
		}
		awaitSync(t, name, zone)
		if b := bannedUntil(t, zone, zone, "198.51.100.80"); b != 0 {
			t.Fatalf("a dry run listed the key banned until %d, want no ban", b)
		}
		awaitSync(t, name, zone)
		wantListing(t, zone, map[string]string{zone + "/198.51.100.80": "2 3"})
		got := scrape(t, zone)
		if n := got[series("dry_run_bans_total", zone, "")]; n != 1 {
			t.Fatalf("dry_run_bans_total = %v, want 1 (the ban it would have started)", n)
		}
		if n := got[series("requests_total", zone, "dry_run")]; n != 3 {
			t.Fatalf("dry_run results = %v, want 3", n)
		}
		// Live now: the counts carried over; no ban was waiting.
		s.reload(trustLoopback, fmt.Sprintf(site, zone, "", store))
		awaitSync(t, name, zone)
		wantListing(t, zone, map[string]string{zone + "/198.51.100.80": "2 3"})
		awaitSync(t, name, zone)
		if b := bannedUntil(t, zone, zone, "198.51.100.80"); b != 0 {
			t.Fatalf("after the reload the key is banned until %d, want no ban", b)
		}
		// Its first live refusal bans it, as one under the live config
		// from the start would be: every later refusal waits for the
		// ban's end, not the window's.
		for i := range 3 {
			resp := request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.80")
			ra, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
			if resp.StatusCode != http.StatusTooManyRequests || ra < 590 || ra > 600 {
				t.Fatalf("live request %d: %d, Retry-After %q, want 429 and the ban's 600 s",
					i+1, resp.StatusCode, resp.Header.Get("Retry-After"))
			}
		}
		awaitSync(t, name, zone)
		if b := bannedUntil(t, zone, zone, "198.51.100.80"); b < time.Now().Add(590*time.Second).Unix() {
			t.Fatalf("after its first live refusal the key is banned until %d, want 10 minutes from now", b)
		}
	})
}

// The bucket of requests without a key (missing <value>) is its own: a
// client cannot name it with a header, and a ban never locks it. A limit
// with ban off is never banned either; its count still refuses.
func TestSharedBucketsNeverBanned(t *testing.T) {
	forEachStore(t, func(t *testing.T, name, store string) {
		zone := "e2e-shared-" + name
		s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		window 60
		max 100
		ban 10m escalate 1h
		limit tenant 3 60 {
			key {http.request.header.X-Tenant}
			missing anon
		}
		limit team 2 60 {
			key {http.request.header.X-Team}
			ban off
		}
		%s
	}
	respond "ok"
}`, zone, store))
		// Five clients without a tenant: three fill the shared bucket.
		var codes []int
		for i := range 5 {
			codes = append(codes, request(t, s.Base, "/", "X-Forwarded-For", fmt.Sprintf("198.51.100.%d", 90+i)).StatusCode)
		}
		if fmt.Sprint(codes) != "[200 200 200 429 429]" {
			t.Fatalf("five clients without a tenant: %v, want [200 200 200 429 429]", codes)
		}
		awaitSync(t, name, zone)
		if b := bannedUntil(t, zone, "tenant", "missing:anon"); b != 0 {
			t.Fatalf("the missing bucket is banned until %d, want never", b)
		}
		awaitSync(t, name, zone)
		wantListing(t, zone, map[string]string{"tenant/missing:anon": "3 2"})
		// An unrelated client without a tenant: refused by the count
		// until the window ends, not by a ban.
		resp := request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.99")
		wantStatus(t, resp, http.StatusTooManyRequests)
		if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra > 60 {
			t.Fatalf("client without a tenant: Retry-After %d, want at most the window (60)", ra)
		}
		// A client naming the tenant "anon" has a bucket of its own.
		wantStatus(t, request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.98", "X-Tenant", "anon"), http.StatusOK)
		awaitSync(t, name, zone)
		wantListing(t, zone, map[string]string{"tenant/key:anon": "1 0"})

		// Team blue over its limit: refused, never banned.
		for i, want := range []int{200, 200, 429, 429} {
			resp := request(t, s.Base, "/", "X-Forwarded-For", fmt.Sprintf("198.51.100.%d", 110+i), "X-Tenant", fmt.Sprintf("t%d", i), "X-Team", "blue")
			wantStatus(t, resp, want)
			if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra > 60 {
				t.Fatalf("team request %d: Retry-After %d, want at most the window (ban off)", i+1, ra)
			}
		}
		awaitSync(t, name, zone)
		if b := bannedUntil(t, zone, "team", "key:blue"); b != 0 {
			t.Fatalf("team blue, with ban off, is banned until %d", b)
		}
	})
}
