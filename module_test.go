package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
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
		name     string
		max      int
		key      string
		disabled bool // the floor: the harness and a handler that passes the request on
		// server is the server the handler is in: one that would take a
		// client IP from the leftmost X-Forwarded-For entry makes the
		// handler ask each request whether it came through a trusted
		// proxy, which none of these did (proxy.go).
		server *caddyhttp.Server
		plans  bool // the request's plan, of three, named by a variable (as vars or map set it)
		// inFlight caps the key's requests in flight (max_in_flight):
		// each request takes a slot and gives it back.
		inFlight int
		// clients is how many X-Client values the requests cycle through
		// (0: one).
		clients int
	}{
		{"allowed", MaxRequests, "", false, nil, false, 0, 0},
		{"refused", 1, "", false, nil, false, 0, 0},
		{"header-key", MaxRequests, "{http.request.header.X-Client}", false, nil, false, 0, 0},
		{"header-key-100000-clients", MaxRequests, "{http.request.header.X-Client}", false, nil, false, 0, 100_000},
		{"disabled", MaxRequests, "", true, nil, false, 0, 0},
		{"unproxied", MaxRequests, "", false, &caddyhttp.Server{}, false, 0, 0},
		{"plans", MaxRequests, "", false, nil, true, 0, 0},
		{"max-in-flight", MaxRequests, "", false, nil, false, 1000, 0},
	} {
		b.Run(tc.name, func(b *testing.B) {
			rl, _ := provisionHandlerIn(b, context.WithValue(context.Background(), caddyhttp.ServerCtxKey, tc.server), "bench_"+tc.name, tc.max, !tc.disabled, func(rl *RateLimit) {
				rl.Key, rl.MaxInFlight = tc.key, tc.inFlight
				if tc.clients > 0 {
					rl.MaxTracked = 2 * tc.clients // room for every client, as bench/load gives them
				}
				if tc.plans {
					rl.PlanBy = "{http.vars.plan}"
					rl.Plans = map[string]PlanConfig{"free": {}, "pro": {PlanLimit: PlanLimit{Max: MaxRequests - 1}}, "partner": {}}
				}
			})
			base := httptest.NewRequest(http.MethodGet, "/", nil)
			base.RemoteAddr = "203.0.113.9:50000" // a client talking to Caddy directly
			base.Header.Set("X-Client", "client-12345")
			ids := make([]string, tc.clients)
			for i := range ids {
				ids[i] = strconv.Itoa(i)
			}
			w := &headerWriter{h: http.Header{}}
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				if len(ids) > 0 {
					base.Header["X-Client"][0] = ids[i%len(ids)]
					i++
				}
				// Fresh variables and a fresh replacer, as the server
				// gives every request: their 13 allocations (1088 B,
				// measured without the handler) count in allocs/op too.
				// Every case has the plan variable, which only plans read.
				r := *base
				r = *r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.9", caddyhttp.TrustedProxyVarKey: false, "plan": "pro"}))
				caddyhttp.NewTestReplacer(&r)
				_ = rl.ServeHTTP(w, &r, next)
			}
		})
	}
}

// benchServe provisions rl (Zone, Max and the options under test set) and
// runs its admitted path in the benchmark loop for requests from one client
// IP with the given headers (name, value pairs).
func benchServe(b *testing.B, rl *RateLimit, headers ...string) {
	benchServeNext(b, rl, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil }), headers...)
}

// benchServeNext is benchServe with next as the handler after rl.
func benchServeNext(b *testing.B, rl *RateLimit, next caddyhttp.Handler, headers ...string) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	on := true
	rl.Enabled = &on
	if rl.Window == 0 {
		rl.Window = caddy.Duration(time.Minute)
	}
	if err := rl.Provision(ctx); err != nil {
		b.Fatal(err)
	}
	defer rl.Cleanup()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	for i := 0; i+1 < len(headers); i += 2 {
		r.Header.Set(headers[i], headers[i+1])
	}
	c := context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer())
	c = context.WithValue(c, caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.9"})
	r = r.WithContext(c)
	w := &headerWriter{h: http.Header{}}
	b.ReportAllocs()
	for b.Loop() {
		if err := rl.ServeHTTP(w, r, next); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkServeHTTPCharge is a response that reports its charge (2 in
// X-Tokens) beside one of a fixed cost of 2, on the memory store: the
// charge holds 1 on admission and spends 1 more when the response ends.
func BenchmarkServeHTTPCharge(b *testing.B) {
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		w.Header().Set("X-Tokens", "2")
		w.WriteHeader(http.StatusOK)
		return nil
	})
	for _, tc := range []struct {
		name string
		set  func(*RateLimit)
	}{
		{"cost", func(rl *RateLimit) { rl.Cost = "2" }},
		{"charge", func(rl *RateLimit) { rl.Charge = &ChargeConfig{Header: "X-Tokens"} }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			rl := &RateLimit{Zone: "bench_charge_" + tc.name, Max: MaxRequests}
			tc.set(rl)
			benchServeNext(b, rl, next)
		})
	}
}

// BenchmarkServeHTTPWebSocket is a WebSocket handshake admitted under the
// rate and the socket cap: the socket is counted while next serves it.
func BenchmarkServeHTTPWebSocket(b *testing.B) {
	rl := &RateLimit{Zone: "bench_ws", Max: MaxRequests, WSMaxConnectionsPerIP: 1000}
	benchServe(b, rl, "Connection", "Upgrade", "Upgrade", "websocket",
		"Sec-WebSocket-Version", "13", "Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ==")
	if n := rl.zone.wsOpen("203.0.113.9"); n != 0 {
		b.Fatalf("%d sockets left open after the handshakes", n)
	}
}

// BenchmarkServeHTTPAbuse is the admitted path with each abuse control on,
// beside BenchmarkServeHTTP/allowed with none: count_status gives every
// request's unit back (its status, 200, does not count).
func BenchmarkServeHTTPAbuse(b *testing.B) {
	for _, tc := range []struct {
		name string
		set  func(*RateLimit)
	}{
		{"count_status", func(rl *RateLimit) { rl.CountStatus = []string{"401"} }},
		{"cost", func(rl *RateLimit) { rl.Cost = "2" }},
		{"ban", func(rl *RateLimit) { rl.Ban = caddy.Duration(time.Minute) }},
		{"gcra", func(rl *RateLimit) { rl.Algorithm = AlgorithmGCRA; rl.Window = caddy.Duration(time.Second) }},
	} {
		b.Run(tc.name, func(b *testing.B) {
			rl := &RateLimit{Zone: "bench_abuse_" + tc.name, Max: MaxRequests}
			tc.set(rl)
			benchServe(b, rl)
		})
	}
}

// headerWriter is a ResponseWriter that keeps one header map, so the
// benchmark measures the handler, not a recorder.
type headerWriter struct{ h http.Header }

func (w *headerWriter) Header() http.Header         { return w.h }
func (w *headerWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *headerWriter) WriteHeader(int)             {}

// keyOf provisions nothing: it resolves the key rl would count a request
// from ip with the given headers under.
func keyOf(t *testing.T, rl *RateLimit, ip string, headers ...string) string {
	t.Helper()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	for i := 0; i+1 < len(headers); i += 2 {
		r.Header.Set(headers[i], headers[i+1])
	}
	repl := caddyhttp.NewTestReplacer(r)
	key, err := rl.policies[0].resolve(repl, r.Header, rl.ipKey(ip))
	if err != nil {
		t.Fatal(err)
	}
	return key
}

func TestCustomKey(t *testing.T) {
	long := strings.Repeat("x", 10_000)
	for _, tc := range []struct {
		name, key string
		headers   []string
		want      string
	}{
		{"header", "{http.request.header.X-Api-Key}", []string{"X-Api-Key", "alice"}, "key:alice"},
		// A client cannot spend another client's IP counter by naming it.
		{"header holding an IP", "{http.request.header.X-Api-Key}", []string{"X-Api-Key", "203.0.113.5"}, "key:203.0.113.5"},
		{"missing header", "{http.request.header.X-Api-Key}", nil, "198.51.100.1"},
		{"missing header with fixed text", "{http.request.header.X-Api-Key}-x", nil, "198.51.100.1"},
		{"mistyped placeholder", "{http.request.heder.X-Api-Key}", []string{"X-Api-Key", "alice"}, "198.51.100.1"},
		{"two parts", "{http.request.header.X-Tenant}/{http.request.header.X-User}", []string{"X-User", "bob"}, "key:/bob"},
		{"long key is hashed", "{http.request.header.X-Api-Key}", []string{"X-Api-Key", long}, "key:sha256:"},
		{"client_ip is the IP key", "{client_ip}", nil, "198.51.100.1"},
		{"printable non-ASCII is kept", "{http.request.header.X-Api-Key}", []string{"X-Api-Key", "Zürich ü"}, "key:Zürich ü"},
		{"a bidi override is hashed", "{http.request.header.X-Api-Key}", []string{"X-Api-Key", "abc\u202egpj.exe"}, "key:sha256:"},
		{"a literal U+FFFD is hashed", "{http.request.header.X-Api-Key}", []string{"X-Api-Key", "\ufffd"}, "key:sha256:"},
		{"a tab is hashed", "{http.request.header.X-Api-Key}", []string{"X-Api-Key", "a\tb"}, "key:sha256:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			rl := &RateLimit{Zone: "custom_key", Key: tc.key}
			if err := rl.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			defer rl.Cleanup()
			got := keyOf(t, rl, "198.51.100.1", tc.headers...)
			if got != tc.want && !(strings.HasSuffix(tc.want, "sha256:") && strings.HasPrefix(got, tc.want) && len(got) == len(tc.want)+32) {
				t.Fatalf("key = %q, want %q", got, tc.want)
			}
		})
	}
}

// A key that is not printable text is hashed, so that the listing shows it
// faithfully: keys that differ only in bytes a listing would show as U+FFFD,
// or in control characters, get distinct keys, all printable ASCII.
func TestCustomKeyNotPrintable(t *testing.T) {
	t.Parallel()
	seen := map[string]string{}
	for _, raw := range []string{"\xff\xfe", "\xfe\xff", "\ufffd\ufffd", "a\nb", "a\rb", "a\x00b", "a\x7fb", "a\u0085b", "a\u200bb", "\xc0\x80"} {
		k := customKey(raw)
		if !strings.HasPrefix(k, "key:sha256:") || len(k) != len("key:sha256:")+32 {
			t.Errorf("customKey(%q) = %q, want a hash", raw, k)
		}
		if prev, dup := seen[k]; dup {
			t.Errorf("customKey(%q) = customKey(%q) = %q", raw, prev, k)
		}
		seen[k] = raw
	}
	// A value that reads as a hash is hashed, so no client can name a
	// hashed client's counter.
	if hashed := customKey("\xff"); customKey(strings.TrimPrefix(hashed, "key:")) == hashed {
		t.Errorf("the value %q names the counter of the key \"\\xff\"", strings.TrimPrefix(hashed, "key:"))
	}
	for _, raw := range []string{"alice", "a b", "203.0.113.5", "ключ", "鍵", "/../../config/", "sha256"} {
		if k := customKey(raw); k != "key:"+raw {
			t.Errorf("customKey(%q) = %q, want it kept", raw, k)
		}
	}
}

// A client that goes away while a Redis zone decides gets 499, the status
// Caddy's reverse proxy gives a closed request, not 503, and the request is
// not counted as a store error: Redis did nothing wrong.
func TestRedisClientGoneNotStoreError(t *testing.T) {
	srv := redistest.Start(t)
	for _, onError := range []string{limiter.OnErrorLocal, limiter.OnErrorAllow, limiter.OnErrorDeny} {
		t.Run(onError, func(t *testing.T) {
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			rl := &RateLimit{Zone: "client_gone_" + onError, Max: 10, Store: &StoreConfig{Type: StoreRedis, Addresses: []string{srv.Addr}, OnError: onError}}
			if err := rl.Provision(ctx); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { rl.Cleanup() })

			r := httptest.NewRequest(http.MethodGet, "/", nil)
			rctx, gone := context.WithCancel(context.WithValue(r.Context(), caddy.ReplacerCtxKey, caddy.NewReplacer()))
			rctx = context.WithValue(rctx, caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "10.9.0.1"})
			gone()
			w := httptest.NewRecorder()
			called := false
			err := rl.ServeHTTP(w, r.WithContext(rctx), caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
				called = true
				return nil
			}))
			herr, ok := err.(caddyhttp.HandlerError)
			if !ok || herr.StatusCode != 499 {
				t.Fatalf("ServeHTTP = %v, want a 499 handler error", err)
			}
			if called {
				t.Error("the next handler ran for a request the store did not decide")
			}
			if n := rl.zone.results[resultDegradedDenied].Load() + rl.zone.results[resultDegradedAllowed].Load(); n != 0 {
				t.Errorf("degraded count = %d, want 0", n)
			}
			if ra := w.Header().Get("Retry-After"); ra != "" {
				t.Errorf("Retry-After = %q for a client that is gone", ra)
			}
			// A live request is still decided by Redis.
			if code := serve(t, rl, "10.9.0.1"); code != http.StatusOK {
				t.Errorf("live request: status %d, want 200", code)
			}
			if n := rl.zone.results[resultAllowed].Load(); n != 1 {
				t.Errorf("allowed count = %d, want 1", n)
			}
		})
	}
}

// Two rate_limit handlers on one request: the placeholders show each
// handler's values from the moment it decided, the last one's afterwards,
// as they did when each handler set them in the replacer's map; a value
// another module sets in that map still wins. Inside Caddy's server (a
// request with variables) and outside it (none: a custom key then).
func TestPlaceholdersLastHandlerWins(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, key, want string
		vars            bool
	}{
		{"server", "", "203.0.113.9", true},
		{"no_variables", "{http.request.header.X-Client}", "key:c1", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			handler := func(zone string, max int) *RateLimit {
				ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
				t.Cleanup(cancel)
				rl := &RateLimit{Zone: zone + tc.name, Max: max, Window: caddy.Duration(time.Minute), Key: tc.key}
				if err := rl.Provision(ctx); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { rl.Cleanup() })
				return rl
			}
			outer, inner := handler("ph_outer", 10), handler("ph_inner", 5)
			r := httptest.NewRequest(http.MethodGet, "/", nil)
			r.Header.Set("X-Client", "c1")
			if tc.vars {
				r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.9"}))
			}
			repl := caddyhttp.NewTestReplacer(r)
			const all = "{http.rate_limit.zone} {http.rate_limit.key} {http.rate_limit.limit} {http.rate_limit.remaining} {http.rate_limit.exceeded} {http.rate_limit.unknown}"
			var between, last string
			final := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
				last = repl.ReplaceAll(all, "-")
				return nil
			})
			err := outer.ServeHTTP(&headerWriter{h: http.Header{}}, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				between = repl.ReplaceAll(all, "-")
				return inner.ServeHTTP(w, r, final)
			}))
			if err != nil {
				t.Fatal(err)
			}
			if want := "ph_outer" + tc.name + " " + tc.want + " 10 9 false -"; between != want {
				t.Errorf("after the first handler: %q, want %q", between, want)
			}
			if want := "ph_inner" + tc.name + " " + tc.want + " 5 4 false -"; last != want {
				t.Errorf("after the second handler: %q, want %q", last, want)
			}
			repl.Set("http.rate_limit.exceeded", true)
			if got, want := repl.ReplaceAll("{http.rate_limit.exceeded} {http.rate_limit.zone}", "-"), "true ph_inner"+tc.name; got != want {
				t.Errorf("with exceeded set in the map: %q, want %q", got, want)
			}
		})
	}
}

// Each handler's quota header values stay as it set them when a second
// rate_limit handler on the same request sets its own (they are written
// into memory kept with the request's placeholders), and a limit name too
// long for that memory still gives whole values.
func TestHeaderValuesPerHandler(t *testing.T) {
	t.Parallel()
	long := "ph_long_" + strings.Repeat("n", 80)
	handler := func(zone string, max int) *RateLimit {
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		t.Cleanup(cancel)
		rl := &RateLimit{Zone: zone, Max: max, Window: caddy.Duration(time.Minute), Headers: HeadersBoth}
		if err := rl.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { rl.Cleanup() })
		return rl
	}
	outer, inner := handler("ph_hdr_outer", 12345), handler(long, 7)
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.9"}))
	caddyhttp.NewTestReplacer(r)
	w1, w2 := &headerWriter{h: http.Header{}}, &headerWriter{h: http.Header{}}
	err := outer.ServeHTTP(w1, r, caddyhttp.HandlerFunc(func(_ http.ResponseWriter, r *http.Request) error {
		return inner.ServeHTTP(w2, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil }))
	}))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		h                                    http.Header
		name, limit, remaining, policyHeader string
	}{
		{w1.h, "ph_hdr_outer", "12345", "12344", `"ph_hdr_outer";q=12345;w=60`},
		{w2.h, long, "7", "6", `"` + long + `";q=7;w=60`},
	} {
		for field, want := range map[string]string{
			"X-Ratelimit-Limit":     tc.limit,
			"X-Ratelimit-Remaining": tc.remaining,
			"Ratelimit-Policy":      tc.policyHeader,
		} {
			if got := tc.h.Values(field); len(got) != 1 || got[0] != want {
				t.Errorf("%s: %s = %q, want [%q]", tc.name, field, got, want)
			}
		}
		if got, want := tc.h.Get("RateLimit"), `"`+tc.name+`";r=`+tc.remaining+`;t=`; !strings.HasPrefix(got, want) || (got != want+"60" && got != want+"59") {
			t.Errorf("%s: RateLimit = %q, want %s60", tc.name, got, want)
		}
	}
}

// A refusal's values share the request's buffer: the remaining count, the
// RateLimit field and Retry-After each keep their own bytes.
func TestHeaderValuesOfRefusal(t *testing.T) {
	t.Parallel()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	rl := &RateLimit{Zone: "hdr_refusal", Max: 1, Window: caddy.Duration(time.Minute), Headers: HeadersBoth}
	if err := rl.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer rl.Cleanup()
	next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
	var h http.Header
	for i := range 2 {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.9"}))
		caddyhttp.NewTestReplacer(r)
		w := &headerWriter{h: http.Header{}}
		err := rl.ServeHTTP(w, r, next)
		if (err != nil) != (i == 1) {
			t.Fatalf("request %d: ServeHTTP = %v", i+1, err)
		}
		h = w.h
	}
	ra := h.Get("Retry-After")
	if ra != "60" && ra != "59" {
		t.Errorf("Retry-After = %q, want 60", ra)
	}
	if got := h.Get("X-Ratelimit-Remaining"); got != "0" {
		t.Errorf("X-RateLimit-Remaining = %q, want 0", got)
	}
	if got := h.Get("RateLimit"); got != `"hdr_refusal";r=0;t=`+ra {
		t.Errorf("RateLimit = %q, want %q", got, `"hdr_refusal";r=0;t=`+ra)
	}
}
