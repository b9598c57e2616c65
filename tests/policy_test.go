package tests

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// policySite is a handler with three limits: 5 per minute per client IP
// (the zone's own), a burst of 2 per 10 s, and a tenant limit of 4 per
// minute keyed by X-Tenant ("public" when absent); /strict also rejects a
// request without X-User.
const policySite = `
:$PORT {
	handle /strict {
		rate_limit {
			zone %[1]s-strict
			key {http.request.header.X-User}
			missing reject
		}
		respond "ok"
	}
	rate_limit {
		zone %[1]s
		window 60
		max 5
		headers both
		limit burst 2 10s
		limit tenant 4 1m {
			key {http.request.header.X-Tenant}
			missing public
		}
	}
	respond "ok"
}`

// listingOf returns the listing's keys as "policy/key count refused" strings.
func listingOf(t *testing.T, zone string) map[string]string {
	t.Helper()
	var list keyList
	adminJSON(t, "/rate_limit/"+zone+"?limit=1000", &list)
	out := map[string]string{}
	for _, k := range list.Keys {
		out[k.Policy+"/"+k.Key] = fmt.Sprintf("%d %d", k.Count, k.Refused)
	}
	return out
}

// wantListing fails the test unless the zone's listing shows each
// "policy/key" of want with its "count refused".
func wantListing(t *testing.T, zone string, want map[string]string) {
	t.Helper()
	got := listingOf(t, zone)
	for k, w := range want {
		if got[k] != w {
			t.Errorf("%s listing %s = %q, want %q (count refused; all: %v)", zone, k, got[k], w, got)
		}
	}
}

// Several limits in one handler: every response names them all in
// RateLimit-Policy and the binding one in the other headers; a request
// refused by one limit is counted in none; a missing tenant is counted as
// "public"; a missing user, with missing reject, is a 400 counted invalid.
func TestPolicies(t *testing.T) {
	zone := "e2e-policy"
	s := startCaddy(t, trustLoopback, fmt.Sprintf(policySite, zone))
	get := func(ip, tenant string) *http.Response {
		h := []string{"X-Forwarded-For", ip}
		if tenant != "" {
			h = append(h, "X-Tenant", tenant)
		}
		resp, _ := s.get("/", h...)
		return resp
	}

	resp := get("203.0.113.1", "acme")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "RateLimit-Policy", `"e2e-policy";q=5;w=60, "burst";q=2;w=10, "tenant";q=4;w=60`)
	// The burst has the least left: 1 of 2.
	wantHeader(t, resp, "X-RateLimit-Limit", "2")
	wantHeader(t, resp, "X-RateLimit-Remaining", "1")
	if rl := resp.Header.Get("RateLimit"); !strings.HasPrefix(rl, `"burst";r=1;t=`) {
		t.Errorf("RateLimit = %q, want the burst limit named", rl)
	}
	wantStatus(t, get("203.0.113.1", "acme"), http.StatusOK)
	// The third within 10 s: the burst refuses; nothing is counted.
	resp = get("203.0.113.1", "acme")
	wantStatus(t, resp, http.StatusTooManyRequests)
	if ra, _ := strconv.Atoi(resp.Header.Get("Retry-After")); ra < 1 || ra > 10 {
		t.Errorf("Retry-After = %q, want the burst window's wait (1 to 10)", resp.Header.Get("Retry-After"))
	}
	if rl := resp.Header.Get("RateLimit"); !strings.HasPrefix(rl, `"burst";r=0;t=`) {
		t.Errorf("RateLimit = %q, want the refusing burst limit named", rl)
	}
	// Two other clients of acme spend the tenant's last 2; the next acme
	// request is refused by the tenant alone, and its client's counts
	// stay as they were.
	wantStatus(t, get("203.0.113.2", "acme"), http.StatusOK)
	wantStatus(t, get("203.0.113.3", "acme"), http.StatusOK)
	resp = get("203.0.113.4", "acme")
	wantStatus(t, resp, http.StatusTooManyRequests)
	if rl := resp.Header.Get("RateLimit"); !strings.HasPrefix(rl, `"tenant";r=0;t=`) {
		t.Errorf("RateLimit = %q, want the tenant limit named", rl)
	}
	// No tenant: counted as public.
	wantStatus(t, get("203.0.113.5", ""), http.StatusOK)

	wantListing(t, zone, map[string]string{
		"e2e-policy/203.0.113.1": "2 0", "burst/203.0.113.1": "2 1",
		"e2e-policy/203.0.113.2": "1 0", "burst/203.0.113.2": "1 0",
		"e2e-policy/203.0.113.3": "1 0", "burst/203.0.113.3": "1 0",
		"tenant/key:acme":        "4 1",
		"e2e-policy/203.0.113.5": "1 0", "burst/203.0.113.5": "1 0", "tenant/missing:public": "1 0",
	})
	got := listingOf(t, zone)
	// 203.0.113.4 was refused by the tenant before any count: none of its
	// limits tracks it at all.
	for k := range got {
		if strings.HasSuffix(k, "/203.0.113.4") {
			t.Errorf("the refused request left %s = %q", k, got[k])
		}
	}
	checkListing(t, zone, []listingCase{{"?policy=tenant", 2, "key:acme missing:public"}})
	if status, body := admin(t, http.MethodGet, "/rate_limit/"+zone+"?policy=nope"); status != http.StatusBadRequest || !strings.Contains(body, `unknown policy`) {
		t.Errorf("?policy=nope: %d %s, want a 400", status, body)
	}
	// Unblocking the tenant in its limit only admits acme again.
	if status, body := admin(t, http.MethodDelete, "/rate_limit/"+zone+"?key=key:acme&policy=tenant"); status != http.StatusOK {
		t.Fatalf("DELETE tenant: %d %s", status, body)
	}
	wantStatus(t, get("203.0.113.4", "acme"), http.StatusOK)

	// missing reject: a 400, counted invalid, nothing stored.
	resp, body := s.get("/strict")
	wantStatus(t, resp, http.StatusBadRequest)
	if resp, _ := s.get("/strict", "X-User", "alice"); resp.StatusCode != http.StatusOK {
		t.Errorf("/strict with a user: %d", resp.StatusCode)
	}
	m := scrape(t, zone+"-strict")
	if m[series("requests_total", zone+"-strict", "invalid")] != 1 || m[series("requests_total", zone+"-strict", "allowed")] != 1 {
		t.Errorf("strict zone metrics = %v (body %q), want invalid 1 and allowed 1", m, body)
	}
	m = scrape(t, zone)
	if m[refusalSeries(zone, "burst")] != 1 || m[refusalSeries(zone, "tenant")] != 1 {
		t.Errorf("refusals by limit = %v, want burst 1 and tenant 1", m)
	}
}

// dry_run lets every request through with the headers of the verdict and
// counts what it would have refused; exempt ranges are neither counted nor
// given headers; status sets the refusal's status.
func TestDryRunExemptStatus(t *testing.T) {
	s := startCaddy(t, trustLoopback, `
:$PORT {
	handle /dry {
		rate_limit {
			zone e2e-dry
			max 1
			dry_run
		}
		respond "ok"
	}
	handle /exempt {
		rate_limit {
			zone e2e-exempt
			max 1
			exempt 198.51.100.0/24 2001:db8::1
		}
		respond "ok"
	}
	handle /status {
		rate_limit {
			zone e2e-status
			max 1
			status 503
		}
		respond "ok"
	}
}`)
	for i := range 3 {
		resp, _ := s.get("/dry", "X-Forwarded-For", "203.0.113.9")
		wantStatus(t, resp, http.StatusOK)
		if i > 0 {
			wantHeader(t, resp, "X-RateLimit-Remaining", "0")
		}
	}
	m := scrape(t, "e2e-dry")
	if m[series("requests_total", "e2e-dry", "dry_run")] != 2 || m[series("requests_total", "e2e-dry", "allowed")] != 1 || m[series("requests_total", "e2e-dry", "limited")] != 0 {
		t.Errorf("dry run metrics = %v, want allowed 1, dry_run 2, limited 0", m)
	}

	for _, ip := range []string{"198.51.100.7", "2001:db8::1"} {
		for range 3 {
			resp, _ := s.get("/exempt", "X-Forwarded-For", ip)
			wantStatus(t, resp, http.StatusOK)
			if h := resp.Header.Get("X-RateLimit-Limit"); h != "" {
				t.Errorf("exempt %s got X-RateLimit-Limit %q", ip, h)
			}
		}
	}
	s.get("/exempt", "X-Forwarded-For", "203.0.113.9")
	resp, _ := s.get("/exempt", "X-Forwarded-For", "203.0.113.9")
	wantStatus(t, resp, http.StatusTooManyRequests)
	if got := listingOf(t, "e2e-exempt"); len(got) != 1 {
		t.Errorf("exempt listing = %v, want only 203.0.113.9", got)
	}

	s.get("/status", "X-Forwarded-For", "203.0.113.9")
	resp, _ = s.get("/status", "X-Forwarded-For", "203.0.113.9")
	wantStatus(t, resp, http.StatusServiceUnavailable)
	if resp.Header.Get("Retry-After") == "" {
		t.Error("a 503 refusal without Retry-After")
	}
}

// The sliding window carries the last window's count into the next: a
// client that spent max just before the edge is refused just after it,
// where the fixed window admits it afresh. With max 2 the carried count
// refuses for the first half of the next window. The zones' clock is the
// test's.
func TestAlgorithmSliding(t *testing.T) {
	fixed, sliding := fresh("e2e-fixed"), fresh("e2e-sliding")
	clk := fakeClock(t, fixed, sliding)
	s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	handle /fixed {
		rate_limit {
			zone %s
			window 1
			max 2
		}
		respond "ok"
	}
	handle /sliding {
		rate_limit {
			zone %s
			window 1
			max 2
			algorithm sliding
		}
		respond "ok"
	}
}`, fixed, sliding))
	for _, p := range []string{"/fixed", "/sliding"} {
		for range 2 {
			resp, _ := s.get(p, "X-Forwarded-For", "203.0.113.10")
			wantStatus(t, resp, http.StatusOK)
		}
	}
	clk.Advance(time.Second) // the fixed window is over
	resp, _ := s.get("/fixed", "X-Forwarded-For", "203.0.113.10")
	wantStatus(t, resp, http.StatusOK)
	resp, _ = s.get("/sliding", "X-Forwarded-For", "203.0.113.10")
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "Retry-After", "1")
	z := zoneSummary(t, sliding)
	if z["algorithm"] != "sliding" {
		t.Errorf("zone = %v, want algorithm sliding", z)
	}
}

// Two Caddy instances on one Redis, 64 concurrent clients over 8 tenants,
// each request judged by a per-client limit and a per-tenant limit: no
// limit admits more than its max across the fleet, and the counts in Redis
// are exactly the requests admitted, so no refused request left a count.
func TestPoliciesTwoInstancesAtomic(t *testing.T) {
	srv := redistest.Start(t)
	const clients, perClient, tenants = 64, 6, 8
	site := fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone e2e-policy-fleet
		window 60
		max 4
		key {http.request.header.X-Client}
		limit tenant 10 1m {
			key {http.request.header.X-Tenant}
		}
		store redis {
			address %s
			timeout 2s
			on_error deny
		}
	}
	respond "ok"
}`, srv.Addr)
	a := startCaddy(t, "", site)
	b := startCaddyProcess(t, site)
	bases := []string{a.Base, b}
	var admitted [clients]atomic.Int64
	var other atomic.Int64
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range perClient {
				req, _ := http.NewRequest(http.MethodGet, bases[(c+i)%2]+"/", nil)
				req.Header.Set("X-Client", fmt.Sprintf("c%d", c))
				req.Header.Set("X-Tenant", fmt.Sprintf("t%d", c%tenants))
				resp, err := loadClient.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				switch resp.StatusCode {
				case http.StatusOK:
					admitted[c].Add(1)
				case http.StatusTooManyRequests:
				default:
					other.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if other.Load() != 0 {
		t.Fatalf("%d answers neither 200 nor 429", other.Load())
	}
	perTenant := map[string]int64{}
	for c := range clients {
		if n := admitted[c].Load(); n > 4 {
			t.Errorf("client c%d admitted %d, over 4", c, n)
		}
		perTenant[fmt.Sprintf("key:t%d", c%tenants)] += admitted[c].Load()
	}
	got := listingOf(t, "e2e-policy-fleet")
	for tenant, n := range perTenant {
		if n > 10 {
			t.Errorf("tenant %s admitted %d, over 10", tenant, n)
		}
		if c := got["tenant/"+tenant]; !strings.HasPrefix(c, fmt.Sprint(n)+" ") {
			t.Errorf("tenant %s counts %q in Redis, admitted %d", tenant, c, n)
		}
	}
	for c := range clients {
		key := fmt.Sprintf("e2e-policy-fleet/key:c%d", c)
		if n := admitted[c].Load(); n > 0 && !strings.HasPrefix(got[key], fmt.Sprint(n)+" ") {
			t.Errorf("%s counts %q in Redis, admitted %d", key, got[key], n)
		}
	}
}
