package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestWSAcquireRelease(t *testing.T) {
	t.Parallel()
	z := new(zone)
	r1, ok1 := z.wsAcquire("a", 2)
	r2, ok2 := z.wsAcquire("a", 2)
	_, ok3 := z.wsAcquire("a", 2)
	if !ok1 || !ok2 || ok3 {
		t.Fatalf("cap 2: admitted %t %t %t, want true true false", ok1, ok2, ok3)
	}
	rb, okb := z.wsAcquire("b", 2)
	if !okb {
		t.Fatal("key b refused for key a's sockets")
	}
	if got := z.wsLive.Load(); got != 3 {
		t.Errorf("wsLive = %d, want 3", got)
	}

	r1()
	r1() // a second release of the same slot gives nothing back
	if got := z.wsOpen("a"); got != 1 {
		t.Errorf("open(a) after releasing one slot twice = %d, want 1", got)
	}
	if _, ok := z.wsAcquire("a", 1); ok {
		t.Error("cap 1 admitted a second socket for a")
	}
	r2()
	rb()
	if got := z.wsLive.Load(); got != 0 {
		t.Errorf("wsLive after every release = %d, want 0", got)
	}
	if n := len(z.ws.live); n != 0 {
		t.Errorf("%d keys left in the map after every release, want none", n)
	}

	// No cap: any number.
	for i := range 100 {
		if _, ok := z.wsAcquire("c", 0); !ok {
			t.Fatalf("no cap: socket %d refused", i)
		}
	}
	if got := z.wsOpen("c"); got != 100 {
		t.Errorf("open(c) = %d, want 100", got)
	}
}

func TestWSAcquireConcurrent(t *testing.T) {
	t.Parallel()
	const limit = 3
	z := new(zone)
	var inFlight, peak atomic.Int64
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				key := fmt.Sprintf("k%d", (g+i)%2)
				release, ok := z.wsAcquire(key, limit)
				if !ok {
					continue
				}
				if key == "k0" {
					n := inFlight.Add(1)
					for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
					}
					inFlight.Add(-1)
				}
				release()
				release()
			}
		})
	}
	wg.Wait()
	if p := peak.Load(); p > limit {
		t.Errorf("%d sockets of one key open at once, cap %d", p, limit)
	}
	if got := z.wsLive.Load(); got != 0 {
		t.Errorf("wsLive = %d, want 0", got)
	}
	if n := len(z.ws.live); n != 0 {
		t.Errorf("%d keys left in the map, want none", n)
	}
}

func TestIsWebSocket(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		proto  int
		method string
		header http.Header
		h3     bool
		want   bool
	}{
		{"upgrade", 1, "GET", http.Header{"Connection": {"Upgrade"}, "Upgrade": {"websocket"}}, false, true},
		{"case and lists", 1, "GET", http.Header{"Connection": {"keep-alive, upgrade"}, "Upgrade": {"WebSocket"}}, false, true},
		{"no connection upgrade", 1, "GET", http.Header{"Upgrade": {"websocket"}}, false, false},
		{"other protocol", 1, "GET", http.Header{"Connection": {"Upgrade"}, "Upgrade": {"h2c"}}, false, false},
		{"plain", 1, "GET", http.Header{}, false, false},
		{"http2 extended connect", 2, "CONNECT", http.Header{":protocol": {"websocket"}}, false, true},
		{"http2 plain connect", 2, "CONNECT", http.Header{}, false, false},
		{"http3 extended connect", 3, "CONNECT", http.Header{}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest(tc.method, "/", nil)
			r.ProtoMajor, r.Header = tc.proto, tc.header
			if tc.h3 {
				r.Proto = "websocket" // as quic-go sets it
			}
			if got := isWebSocket(r); got != tc.want {
				t.Errorf("isWebSocket = %t, want %t", got, tc.want)
			}
		})
	}
}

// canTakeOver sees through Caddy's ResponseWriter wrappers to net/http's
// hijackable writer, and refuses what websocket.Accept would not complete.
func TestCanTakeOver(t *testing.T) {
	t.Parallel()
	got := make(chan bool, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// As Caddy's handlers wrap it: wrappers that only Unwrap, around a
		// recorder that hijacks through what it wraps.
		rec := caddyhttp.NewResponseRecorder(&caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, nil, nil)
		got <- canTakeOver(&caddyhttp.ResponseWriterWrapper{ResponseWriter: rec}, r)
	}))
	defer srv.Close()

	handshake := func() http.Header {
		return http.Header{
			"Connection":            {"Upgrade"},
			"Upgrade":               {"websocket"},
			"Sec-Websocket-Version": {"13"},
			"Sec-Websocket-Key":     {"dGhlIHNhbXBsZSBub25jZQ=="},
		}
	}
	for _, tc := range []struct {
		name   string
		method string
		edit   func(http.Header)
		want   bool
	}{
		{"handshake", "GET", func(http.Header) {}, true},
		{"post", "POST", func(http.Header) {}, false},
		{"version 8", "GET", func(h http.Header) { h.Set("Sec-Websocket-Version", "8") }, false},
		{"no key", "GET", func(h http.Header) { h.Del("Sec-Websocket-Key") }, false},
		{"short key", "GET", func(h http.Header) { h.Set("Sec-Websocket-Key", "c2hvcnQ=") }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(tc.method, srv.URL, nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header = handshake()
			tc.edit(req.Header)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if g := <-got; g != tc.want {
				t.Errorf("canTakeOver = %t, want %t", g, tc.want)
			}
		})
	}

	r := httptest.NewRequest("GET", "/", nil)
	r.Header = handshake()
	if canTakeOver(httptest.NewRecorder(), r) {
		t.Error("canTakeOver = true for a ResponseWriter that cannot be hijacked")
	}
	r.ProtoMajor, r.ProtoMinor = 2, 0
	if canTakeOver(httptest.NewRecorder(), r) {
		t.Error("canTakeOver = true for HTTP/2")
	}
}

// provisioned returns a handler provisioned in a context of its own.
func provisioned(t *testing.T, rl *RateLimit) *RateLimit {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := rl.Provision(ctx); err != nil {
		t.Fatalf("provisioning: %v", err)
	}
	t.Cleanup(func() { rl.Cleanup() })
	return rl
}

// extendedConnect is an HTTP/2 WebSocket (RFC 8441) request from ip.
func extendedConnect(ip string) (*http.Request, *httptest.ResponseRecorder) {
	r := httptest.NewRequest(http.MethodConnect, "/", nil)
	r.Proto, r.ProtoMajor, r.ProtoMinor = "HTTP/2.0", 2, 0
	r.Header.Set(":protocol", "websocket")
	r.RemoteAddr = ip + ":40000"
	w := httptest.NewRecorder()
	r = caddyhttp.PrepareRequest(r, caddy.NewReplacer(), w, nil)
	// What the server sets from the peer address; with no server,
	// PrepareRequest leaves it empty.
	caddyhttp.SetVar(r.Context(), caddyhttp.ClientIPVarKey, ip)
	return r, w
}

// An HTTP/2 WebSocket cannot be taken over: over the cap or over the rate it
// is refused with 429, and its slot is held while next serves it.
func TestExtendedConnectRefused429(t *testing.T) {
	t.Parallel()
	rl := provisioned(t, &RateLimit{Zone: "unit_h2", Window: caddy.Duration(60e9), Max: 3, WSMaxConnectionsPerIP: 1})

	var inner error
	var innerOpen int
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		innerOpen = rl.zone.wsOpen("192.0.2.1")
		r2, w2 := extendedConnect("192.0.2.1")
		inner = rl.ServeHTTP(w2, r2, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			t.Error("second socket passed on over the cap")
			return nil
		}))
		return nil
	})
	r, w := extendedConnect("192.0.2.1")
	if err := rl.ServeHTTP(w, r, next); err != nil {
		t.Fatalf("first socket: %v", err)
	}
	if innerOpen != 1 {
		t.Errorf("open while next serves the socket = %d, want 1", innerOpen)
	}
	want429(t, inner, "over the cap")
	if got := rl.zone.wsOpen("192.0.2.1"); got != 0 {
		t.Errorf("open after next returned = %d, want 0", got)
	}

	// Request 3 passes; request 4 is over the rate.
	r, w = extendedConnect("192.0.2.1")
	if err := rl.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })); err != nil {
		t.Fatalf("third request: %v", err)
	}
	r, w = extendedConnect("192.0.2.1")
	err := rl.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		t.Error("socket over the rate passed on")
		return nil
	}))
	want429(t, err, "over the rate")
	if w.Header().Get("Retry-After") == "" || w.Header().Get("X-RateLimit-Remaining") != "0" {
		t.Errorf("headers over the rate: %v", w.Header())
	}
}

// want429 fails the test unless err is a handler error with status 429.
func want429(t *testing.T, err error, what string) {
	t.Helper()
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) || he.StatusCode != http.StatusTooManyRequests {
		t.Errorf("%s: error = %v, want a 429", what, err)
	}
}

func TestUnmarshalCaddyfileWebSocket(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		input   string
		max     int
		reject  string
		wantErr string
	}{
		{"ws_max_connections_per_ip 5", 5, "", ""},
		{"wsMaxConnectionsPerIp 7", 7, "", ""},
		{"ws_reject status", 0, WSRejectStatus, ""},
		{"ws_reject close", 0, WSRejectClose, ""},
		{"ws_max_connections_per_ip 0", 0, "", `invalid ws_max_connections_per_ip "0": must be at least 1`},
		{"wsMaxConnectionsPerIp many", 0, "", `invalid wsMaxConnectionsPerIp "many": not an integer`},
		{"ws_max_connections_per_ip 5 6", 0, "", `ws_max_connections_per_ip takes one argument, got extra "6"`},
		{"ws_reject drop", 0, "", `invalid ws_reject "drop": must be close or status`},
		{"ws_reject", 0, "", "wrong argument count"},
	} {
		t.Run(tc.input, func(t *testing.T) {
			rl := parse(t, "rate_limit {\n"+tc.input+"\n}", tc.wantErr)
			if rl == nil {
				return
			}
			if rl.WSMaxConnectionsPerIP != tc.max || rl.WSReject != tc.reject {
				t.Errorf("got ws_max_connections_per_ip %d, ws_reject %q; want %d, %q",
					rl.WSMaxConnectionsPerIP, rl.WSReject, tc.max, tc.reject)
			}
		})
	}
}

func TestValidateWebSocket(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		rl      RateLimit
		wantErr string
	}{
		{RateLimit{WSMaxConnectionsPerIP: 10, WSReject: WSRejectStatus}, ""},
		{RateLimit{WSMaxConnectionsPerIP: -1}, "invalid ws_max_connections_per_ip -1"},
		{RateLimit{WSReject: "drop"}, `invalid ws_reject "drop"`},
	} {
		err := tc.rl.check()
		if tc.wantErr == "" && err != nil {
			t.Errorf("%+v: %v", tc.rl, err)
		}
		if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
			t.Errorf("error = %v, want one containing %q", err, tc.wantErr)
		}
	}
}

// A WebSocket refused for the socket cap, not the rate, shows as exceeded in
// its placeholders, as handle_errors renders any refusal; the socket it was
// refused beside still shows as admitted.
func TestWSCapRefusalExceeded(t *testing.T) {
	rl, _ := provisionHandler(t, "ws_cap_exceeded", MaxRequests, true, func(rl *RateLimit) { rl.WSMaxConnectionsPerIP = 1 })
	wsRequest := func() (*http.Request, *caddy.Replacer) {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header.Set("Connection", "Upgrade")
		r.Header.Set("Upgrade", "websocket")
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{caddyhttp.ClientIPVarKey: "203.0.113.9"}))
		return r, caddyhttp.NewTestReplacer(r)
	}
	first, firstRepl := wsRequest()
	var refusal error
	var exceeded any
	err := rl.ServeHTTP(&headerWriter{h: http.Header{}}, first, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		// The first socket is open while next serves it: a second is
		// over the cap.
		second, repl := wsRequest()
		refusal = rl.ServeHTTP(&headerWriter{h: http.Header{}}, second, caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
			t.Error("the second socket was served past the cap of 1")
			return nil
		}))
		exceeded, _ = repl.Get("http.rate_limit.exceeded")
		return nil
	}))
	if err != nil {
		t.Fatalf("first socket: %v", err)
	}
	var herr caddyhttp.HandlerError
	if !errors.As(refusal, &herr) || herr.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("second socket: %v, want a 429 handler error", refusal)
	}
	if exceeded != true {
		t.Errorf("second socket: {http.rate_limit.exceeded} = %v, want true", exceeded)
	}
	if v, _ := firstRepl.Get("http.rate_limit.exceeded"); v != false {
		t.Errorf("first socket: {http.rate_limit.exceeded} = %v, want false", v)
	}
}
