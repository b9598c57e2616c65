package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A request with no client IP and no custom key is passed on uncounted and
// without quota headers.
func TestNoKeyNotCounted(t *testing.T) {
	rl, _ := provisionHandler(t, "nokey", 1, true)
	for range 3 {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer())
		ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{})
		w := httptest.NewRecorder()
		called := false
		err := rl.ServeHTTP(w, r.WithContext(ctx), caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			called = true
			return nil
		}))
		if err != nil || !called {
			t.Fatalf("ServeHTTP = %v, next called %t; want nil and called", err, called)
		}
		if h := w.Header().Get("X-RateLimit-Limit"); h != "" {
			t.Fatalf("X-RateLimit-Limit = %q for a request with no key", h)
		}
	}
	if n := rl.zone.store.Len(); n != 0 {
		t.Fatalf("store tracks %d keys, want 0", n)
	}
}

// BenchmarkServeHTTP measures the handler's whole cost for an admitted
// request of a tracked client (headers and placeholders included) and for a
// refused one.
func BenchmarkServeHTTP(b *testing.B) {
	for _, tc := range []struct {
		name string
		max  int
	}{{"allowed", 1 << 30}, {"refused", 1}} {
		b.Run(tc.name, func(b *testing.B) {
			rl, _ := provisionHandler(b, "bench_"+tc.name, tc.max, true)
			r := httptest.NewRequest(http.MethodGet, "/", nil)
			repl := caddy.NewReplacer()
			ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
			ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.9"})
			r = r.WithContext(ctx)
			w := &headerWriter{h: http.Header{}}
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			b.ReportAllocs()
			for b.Loop() {
				_ = rl.ServeHTTP(w, r, next)
			}
		})
	}
}

// headerWriter is a ResponseWriter that keeps one header map, so the
// benchmark measures the handler, not a recorder.
type headerWriter struct{ h http.Header }

func (w *headerWriter) Header() http.Header         { return w.h }
func (w *headerWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *headerWriter) WriteHeader(int)             {}
