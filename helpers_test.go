package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// provisionHandler provisions a handler for zone with max requests per
// minute, as Caddy would, with the options applied to it first, and cleans
// it up when the test ends. Each test names its own zone, since zones are
// process-global.
func provisionHandler(t testing.TB, zoneName string, max int, enabled bool, options ...func(*RateLimit)) (*RateLimit, caddy.Context) {
	t.Helper()
	return provisionHandlerIn(t, context.Background(), zoneName, max, enabled, options...)
}

// provisionHandlerIn is provisionHandler under parent, a context that may
// name the server the handler is in (caddyhttp.ServerCtxKey), as Caddy's
// does.
func provisionHandlerIn(t testing.TB, parent context.Context, zoneName string, max int, enabled bool, options ...func(*RateLimit)) (*RateLimit, caddy.Context) {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: parent})
	rl := &RateLimit{Zone: zoneName, Max: max, Window: caddy.Duration(time.Minute), MaxTracked: 200_000, Enabled: &enabled}
	for _, o := range options {
		o(rl)
	}
	if err := rl.Provision(ctx); err != nil {
		t.Fatalf("provisioning zone %q: %v", zoneName, err)
	}
	t.Cleanup(func() {
		if err := rl.Cleanup(); err != nil {
			t.Errorf("cleanup of zone %q: %v", zoneName, err)
		}
		cancel()
	})
	return rl, ctx
}

// serve sends one request from client IP ip through rl and returns the
// response status.
func serve(t testing.TB, rl *RateLimit, ip string) int {
	t.Helper()
	return serveVars(t, rl, map[string]any{caddyhttp.ClientIPVarKey: ip})
}

// serveVars is serve for a request whose variables, as Caddy's server sets
// them (client_ip, trusted_proxy), are vars.
func serveVars(t testing.TB, rl *RateLimit, vars map[string]any) int {
	t.Helper()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer())
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, vars)
	w := httptest.NewRecorder()
	err := rl.ServeHTTP(w, r.WithContext(ctx), caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		w.WriteHeader(http.StatusOK)
		return nil
	}))
	if herr, ok := err.(caddyhttp.HandlerError); ok {
		return herr.StatusCode
	}
	if err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	return w.Code
}

// hitN counts n requests for key directly in the zone's store.
func hitN(t testing.TB, rl *RateLimit, key string, n int) {
	t.Helper()
	for range n {
		if _, err := storeHit(rl.zone.store, key, time.Now(), rl.policies[0].check.Limit); err != nil {
			t.Fatal(err)
		}
	}
}

// storeHit decides one request of key against lim alone in s (slot 0,
// name "").
func storeHit(s limiter.Store, key string, now time.Time, lim limiter.Limit) (limiter.Verdict, error) {
	var out [1]limiter.Verdict
	err := s.Decide(context.Background(), []limiter.Check{{Key: key, Limit: lim}}, now, out[:])
	return out[0], err
}
