package tests

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// plansSite is the three layers of docs/plans.md, scaled down: a map from
// the API key to its plan and tenant, per-key plans and a per-tenant
// guard. mapping is the map's lines.
func plansSite(zone, mapping string) string {
	return fmt.Sprintf(`
:$PORT {
	map {http.request.header.X-API-Key} {plan} {tenant} {
%s
	}
	rate_limit {
		zone %s
		key {http.request.header.X-API-Key}
		missing reject
		window 60
		max 2
		limit hourly 5 1h
		limit tenant 3 1m {
			key {tenant}
		}
		plan_by {plan}
		plan pro {
			max 4
			limit hourly 8
			limit tenant 20
		}
		plan partner {
			max 6
			limit hourly off
			limit tenant 20
		}
	}
	respond "{http.rate_limit.plan} {http.rate_limit.limit}"
}`, mapping, zone)
}

// sendKeyed sends n requests with the API key key to s and reports their
// statuses, and the body and X-RateLimit-Limit of the first.
func sendKeyed(s *server, key string, n int) (statuses []int, body, limit string) {
	s.t.Helper()
	for i := range n {
		resp, b := s.get("/", "X-API-Key", key)
		statuses = append(statuses, resp.StatusCode)
		if i == 0 {
			body, limit = b, resp.Header.Get("X-RateLimit-Limit")
		}
	}
	return statuses, body, limit
}

// Three API keys on three plans get their own quotas, named in the
// headers and placeholders; a tenant's keys share its guard; a key that a
// reload maps to a bigger plan mid-window gets the new quota at once,
// against what it has spent.
func TestPlansEndToEnd(t *testing.T) {
	zone := fresh("e2e-plans")
	mapping := `		k-free   free    acme
		k-free2  free    acme
		k-pro    pro     globex
		k-partner partner initech
		k-solo   free    solo`
	s := startCaddy(t, "", plansSite(zone, mapping))
	admitted := func(key string, n int) ([]int, string, string) { return sendKeyed(s, key, n) }
	for _, tc := range []struct {
		key         string
		n           int
		want        string
		body, limit string
	}{
		// "free" is no plan of the handler: the default plan, 2 a minute.
		{"k-free", 3, "[200 200 429]", "default 2", "2"},
		{"k-pro", 5, "[200 200 200 200 429]", "pro 4", "4"},
		// partner: 6 a minute, no hourly cap (the default's 5 would refuse the sixth).
		{"k-partner", 7, "[200 200 200 200 200 200 429]", "partner 6", "6"},
		// k-free2 shares acme's guard of 3 with k-free, which spent 2:
		// the guard binds, and the headers say so.
		{"k-free2", 2, "[200 429]", "default 3", "3"},
	} {
		statuses, body, limit := admitted(tc.key, tc.n)
		if fmt.Sprint(statuses) != tc.want || body != tc.body || limit != tc.limit {
			t.Errorf("%s: %v, first body %q, X-RateLimit-Limit %q; want %s, %q, %q", tc.key, statuses, body, limit, tc.want, tc.body, tc.limit)
		}
	}
	if st, _, _ := admitted("k-solo", 3); fmt.Sprint(st) != "[200 200 429]" {
		t.Fatalf("k-solo on the default plan: %v, want 2 of 3", st)
	}
	// The key moves to pro: 4 a minute, of which it spent 2.
	s.reload("", plansSite(zone, strings.Replace(mapping, "k-solo   free", "k-solo   pro", 1)))
	if st, body, limit := admitted("k-solo", 3); fmt.Sprint(st) != "[200 200 429]" || body != "pro 4" || limit != "4" {
		t.Errorf("k-solo moved to pro: %v, %q, %q; want the 2 left of pro's 4", st, body, limit)
	}
	if got := listingOf(t, zone)[zone+"/key:k-solo"]; !strings.HasPrefix(got, "4 ") {
		t.Errorf("k-solo is listed as %q, want one count of 4 across both plans", got)
	}
	// No key at all: missing reject.
	resp, _ := s.get("/")
	wantStatus(t, resp, http.StatusBadRequest)
}

// The handle_errors bodies of docs/plans.md through a real Caddy: a
// request refused by two limits gets a JSON body naming its plan, both
// limits and when to retry, and RFC 9457 problem details of the
// quota-exceeded type; both parse as JSON and agree with the headers.
func TestRefusalBodies(t *testing.T) {
	zone := fresh("e2e-refusal-bodies")
	s := startCaddy(t, "", fmt.Sprintf(`
:$PORT {
	map {http.request.header.X-API-Key} {plan} {
		k-1 pro
	}
	rate_limit {
		zone %s
		key {http.request.header.X-API-Key}
		window 60
		max 1
		limit hourly 1 1h
		plan_by {plan}
		plan pro {
			max 2
			limit hourly 2
		}
	}
	respond "ok"
	handle_errors 429 {
		handle /problem {
			header Content-Type application/problem+json
			respond `+"`"+`{"type": "https://iana.org/assignments/http-problem-types#quota-exceeded", "title": "Request cannot be satisfied as assigned quota has been exceeded", "status": 429, "detail": "Plan {http.rate_limit.plan}: retry in {http.rate_limit.retry_after} seconds", "violated-policies": {http.rate_limit.violated_json}}`+"`"+` 429
		}
		handle {
			header Content-Type application/json
			respond `+"`"+`{"error": "rate_limited", "plan": "{http.rate_limit.plan}", "limit": "{http.rate_limit.policy}", "max": {http.rate_limit.limit}, "violated": {http.rate_limit.violated_json}, "retry_after": {http.rate_limit.retry_after}, "reset": {http.rate_limit.reset}, "upgrade": "https://example.com/pricing"}`+"`"+` 429
		}
	}
}`, zone))
	for range 2 {
		if resp, _ := s.get("/", "X-API-Key", "k-1"); resp.StatusCode != http.StatusOK {
			t.Fatalf("k-1 within pro's 2: %d", resp.StatusCode)
		}
	}
	resp, body := s.get("/", "X-API-Key", "k-1")
	var got struct {
		Error      string   `json:"error"`
		Plan       string   `json:"plan"`
		Limit      string   `json:"limit"`
		Max        int      `json:"max"`
		Violated   []string `json:"violated"`
		RetryAfter int      `json:"retry_after"`
		Reset      int64    `json:"reset"`
		Upgrade    string   `json:"upgrade"`
	}
	if err := json.Unmarshal([]byte(body), &got); err != nil {
		t.Fatalf("the refusal's body %q is not JSON: %v", body, err)
	}
	retry, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Content-Type") != "application/json" ||
		got.Plan != "pro" || got.Limit != "hourly" || got.Max != 2 || fmt.Sprint(got.Violated) != "["+zone+" hourly]" ||
		got.RetryAfter != retry || retry < 3500 || got.Reset == 0 || got.Upgrade == "" {
		t.Errorf("refusal: %d %s, Retry-After %q: %s %+v; want pro's hourly limit binding, both limits violated, retry as the header says",
			resp.StatusCode, resp.Header.Get("Content-Type"), resp.Header.Get("Retry-After"), body, got)
	}
	resp, body = s.get("/problem", "X-API-Key", "k-1")
	var problem map[string]any
	if err := json.Unmarshal([]byte(body), &problem); err != nil {
		t.Fatalf("the problem details %q are not JSON: %v", body, err)
	}
	if resp.Header.Get("Content-Type") != "application/problem+json" ||
		problem["type"] != "https://iana.org/assignments/http-problem-types#quota-exceeded" || problem["status"] != 429.0 ||
		fmt.Sprint(problem["violated-policies"]) != "["+zone+" hourly]" || problem["detail"] != "Plan pro: retry in "+resp.Header.Get("Retry-After")+" seconds" {
		t.Errorf("problem details: %s %s", resp.Header.Get("Content-Type"), body)
	}
}

// A route whose cost is 0 reads a client's quota without spending it, on
// every store: its answers carry the quota headers, the count stays where
// the priced route put it, and at the max it is still admitted. A cost
// placeholder that resolves to 0 is a probe too; one that resolves empty
// costs 1.
func TestQuotaProbe(t *testing.T) {
	srv := redistest.Start(t)
	for _, store := range []struct{ name, block string }{
		{"memory", ""},
		{"redis", "store redis {\n\t\t\taddress " + srv.Addr + "\n\t\t}"},
		{"sync", "store redis {\n\t\t\taddress " + srv.Addr + "\n\t\t\tsync 100ms\n\t\t}"},
	} {
		t.Run(store.name, func(t *testing.T) {
			zone := fresh("e2e-quota-probe-" + store.name)
			limit := fmt.Sprintf(`rate_limit {
			zone %s
			key {http.request.header.X-API-Key}
			window 3600
			max 3
			cost {cost}
			%s
		}`, zone, store.block)
			s := startCaddy(t, "", fmt.Sprintf(`
:$PORT {
	map {path} {cost} {
		/quota     0
		/free-text ""
		default    1
	}
	%s
	respond "ok"
}`, limit))
			untilWindowLeft(time.Hour, 10*time.Second) // sync aligns the hour to the epoch: waits only in its last 10 seconds
			remaining := func(path string) string {
				resp, _ := s.get(path, "X-API-Key", "k-probe")
				return fmt.Sprintf("%d %s", resp.StatusCode, resp.Header.Get("X-RateLimit-Remaining"))
			}
			var got []string
			for _, path := range []string{"/", "/quota", "/quota", "/free-text", "/quota", "/", "/quota", "/", "/quota"} {
				got = append(got, path+" "+remaining(path))
			}
			want := "[/ 200 2 /quota 200 2 /quota 200 2 /free-text 200 1 /quota 200 1 / 200 0 /quota 200 0 / 429 0 /quota 200 0]"
			if fmt.Sprint(got) != want {
				t.Errorf("got %v\nwant %s", got, want)
			}
		})
	}
}
