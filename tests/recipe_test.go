package tests

import (
	"net/http"
	"os"
	"strings"
	"testing"

	"golang.org/x/crypto/bcrypt"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// recipe returns the Caddyfile of docs/policies.md, between its markers.
func recipe(t *testing.T) string {
	t.Helper()
	doc, err := os.ReadFile("../docs/policies.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), "<!-- recipe -->\n```\n")
	block, _, ok2 := strings.Cut(rest, "```\n<!-- /recipe -->")
	if !ok || !ok2 {
		t.Fatal("docs/policies.md has no recipe between <!-- recipe --> markers")
	}
	return block
}

// The policies recipe of docs/policies.md, as written, against a real Caddy
// and a real redis-server: webhooks are exempt, health has its own profile,
// a login has no user (anonymous) and no tenant (public), routes are
// normalised, a burst refuses and names itself, and when Redis dies auth
// fails closed while reads fail open.
func TestRecipe(t *testing.T) {
	srv := redistest.Start(t)
	hash, err := bcrypt.GenerateFromPassword([]byte("wonderland"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("REDIS_ADDRESS", srv.Addr)
	t.Setenv("ALICE_PASSWORD_HASH", string(hash))
	site := strings.Replace(recipe(t), "{$SITE_ADDRESS:api.example.com}", ":$PORT", 1)
	s := startCaddy(t, trustLoopback, site)

	do := func(method, path, ip string, headers ...string) *http.Response {
		t.Helper()
		req, err := http.NewRequest(method, s.Base+path, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("X-Forwarded-For", ip)
		for i := 0; i+1 < len(headers); i += 2 {
			req.Header.Set(headers[i], headers[i+1])
		}
		if strings.HasPrefix(path, "/api/v1/") {
			req.SetBasicAuth("alice", "wonderland")
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp
	}

	// Webhooks: exempt by path, no headers, never refused.
	for range 30 {
		resp := do(http.MethodPost, "/webhooks/stripe", "203.0.113.30")
		wantStatus(t, resp, http.StatusOK)
		if resp.Header.Get("X-RateLimit-Limit") != "" {
			t.Fatal("a webhook got quota headers")
		}
	}
	// Health: its own high profile; the burst binds first.
	resp := do(http.MethodGet, "/health/live", "203.0.113.31")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "X-RateLimit-Limit", "200")

	// A login: no user, no tenant. The route burst (10 a second) refuses
	// the eleventh and names itself through its max.
	for i := range 11 {
		resp = do(http.MethodPost, "/api/auth/login", "203.0.113.32")
		if i < 10 {
			wantStatus(t, resp, http.StatusOK)
		}
	}
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "X-RateLimit-Limit", "10")
	wantListing(t, "auth", map[string]string{
		"auth/203.0.113.32":                            "10 0",
		"user/missing:anonymous":                       "10 0",
		"tenant/missing:public":                        "10 0",
		"route/key:203.0.113.32 /api/auth/login":       "10 0",
		"route-burst/key:203.0.113.32 /api/auth/login": "10 1",
	})

	// Reads as alice of tenant acme: two user ids are one route.
	wantStatus(t, do(http.MethodGet, "/api/v1/users/123", "203.0.113.33", "X-Tenant", "acme"), http.StatusOK)
	wantStatus(t, do(http.MethodGet, "/api/v1/users/456/orders", "203.0.113.33", "X-Tenant", "acme"), http.StatusOK)
	wantStatus(t, do(http.MethodGet, "/api/v1/users/789", "203.0.113.33", "X-Tenant", "acme"), http.StatusOK)
	wantListing(t, "reads", map[string]string{
		"user/key:alice":  "3 0",
		"tenant/key:acme": "3 0",
		"route/key:203.0.113.33 /api/v1/users/:id":        "2 0",
		"route/key:203.0.113.33 /api/v1/users/:id/orders": "1 0",
	})

	// Redis dies: auth fails closed, reads fail open.
	srv.Stop()
	resp = do(http.MethodPost, "/api/auth/login", "203.0.113.34")
	wantStatus(t, resp, http.StatusServiceUnavailable)
	if resp.Header.Get("Retry-After") == "" {
		t.Error("a fail-closed 503 without Retry-After")
	}
	wantStatus(t, do(http.MethodGet, "/api/v1/users/1", "203.0.113.35"), http.StatusOK)
	m := scrape(t, "auth")
	if m[series("requests_total", "auth", "degraded_denied")] < 1 {
		t.Errorf("auth metrics = %v, want degraded_denied counted", m)
	}
	m = scrape(t, "reads")
	if m[series("requests_total", "reads", "degraded_allowed")] < 1 {
		t.Errorf("reads metrics = %v, want degraded_allowed counted", m)
	}
}
