package ratelimit

import (
	"context"
	"slices"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// inServer returns a context naming srv as the server handlers provisioned
// under it are in.
func inServer(srv *caddyhttp.Server) context.Context {
	return context.WithValue(context.Background(), caddyhttp.ServerCtxKey, srv)
}

// observe sends rl's log to a recorder and returns it.
func observe(rl *RateLimit) *observer.ObservedLogs {
	core, logs := observer.New(zapcore.InfoLevel)
	rl.logger = zap.New(core)
	return logs
}

// viaProxy is the variables of a request from client IP ip that came
// through a trusted proxy (trusted) or straight from the client.
func viaProxy(ip string, trusted bool) map[string]any {
	return map[string]any{caddyhttp.ClientIPVarKey: ip, caddyhttp.TrustedProxyVarKey: trusted}
}

// Which setups warn: only a request through a trusted proxy, to a server
// that takes the leftmost entry of a list header, in a handler that goes
// by the client IP. Each case sends three such requests; a warning is one
// log entry and the zone's flag in the listing.
func TestSpoofableKeyDecision(t *testing.T) {
	t.Parallel()
	lax := func() *caddyhttp.Server { return &caddyhttp.Server{} } // no client_ip_headers: X-Forwarded-For
	headers := func(h ...string) *caddyhttp.Server { return &caddyhttp.Server{ClientIPHeaders: h} }
	key := func(k, missing string) func(*RateLimit) {
		return func(rl *RateLimit) { rl.Key, rl.Missing = k, missing }
	}
	for _, tc := range []struct {
		name    string
		srv     *caddyhttp.Server
		trusted bool
		options []func(*RateLimit)
		uses    []string // what the warning names; nil: no warning
	}{
		{"default key, X-Forwarded-For", lax(), true, nil, []string{"limit z"}},
		{"trusted_proxies_strict", &caddyhttp.Server{TrustedProxiesStrict: 1}, true, nil, nil},
		{"no trusted proxy", lax(), false, nil, nil},
		{"no server", nil, true, nil, nil},
		{"X-Real-IP only", headers("x-real-ip"), true, nil, nil},
		{"single-value headers only", headers("CF-Connecting-IP", "True-Client-IP", "Fly-Client-IP"), true, nil, nil},
		{"X-Real-IP, then X-Forwarded-For", headers("X-Real-IP", "X-Forwarded-For"), true, nil, []string{"limit z"}},
		{"Forwarded", headers("Forwarded"), true, nil, []string{"limit z"}},
		{"a header not known to hold one address", headers("X-Client-Address"), true, nil, []string{"limit z"}},
		{"{client_ip} key", lax(), true, []func(*RateLimit){key("{client_ip}", "")}, []string{"limit z"}},
		{"key holding {http.vars.client_ip}", lax(), true, []func(*RateLimit){key("{http.vars.client_ip}-{http.request.uri.path}", MissingReject)}, []string{"limit z"}},
		{"header key, missing ip", lax(), true, []func(*RateLimit){key("{http.request.header.X-Api-Key}", "")}, []string{"limit z"}},
		{"header key, missing reject", lax(), true, []func(*RateLimit){key("{http.request.header.X-Api-Key}", MissingReject)}, nil},
		{"header key, missing anonymous", lax(), true, []func(*RateLimit){key("{http.request.header.X-Api-Key}", "anonymous")}, nil},
		{"header key, exempt", lax(), true, []func(*RateLimit){key("{http.request.header.X-Api-Key}", MissingReject), func(rl *RateLimit) {
			rl.Exempt = []string{"10.0.0.0/8"}
		}}, []string{"exempt"}},
		{"header key, a limit by IP", lax(), true, []func(*RateLimit){key("{http.request.header.X-Api-Key}", MissingReject), func(rl *RateLimit) {
			rl.Limits = []PolicyConfig{{Name: "per_ip", Max: 9, Window: 60e9, Key: "{client_ip}"}}
		}}, []string{"limit per_ip"}},
		{"ws_max_connections_per_ip", lax(), true, []func(*RateLimit){func(rl *RateLimit) { rl.WSMaxConnectionsPerIP = 3 }}, []string{"limit z", "ws_max_connections_per_ip"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			zone := "proxy_decision_" + t.Name()[len("TestSpoofableKeyDecision/"):]
			var opts []func(*RateLimit)
			opts = append(opts, tc.options...)
			rl, _ := provisionHandlerIn(t, inServer(tc.srv), "z", 100, true, append(opts, func(rl *RateLimit) { rl.Zone = validName(zone) })...)
			logs := observe(rl)
			for range 3 {
				serveVars(t, rl, map[string]any{
					caddyhttp.ClientIPVarKey:     "198.51.100.7",
					caddyhttp.TrustedProxyVarKey: tc.trusted,
				})
			}
			warnings := logs.FilterMessage(spoofableKeyMsg).All()
			flagged := rl.zone.info(context.Background()).SpoofableKey
			if tc.uses == nil {
				if len(warnings) != 0 || flagged {
					t.Fatalf("%d warnings, zone flagged %t; want none", len(warnings), flagged)
				}
				return
			}
			if len(warnings) != 1 || !flagged {
				t.Fatalf("%d warnings, zone flagged %t; want one warning and the flag", len(warnings), flagged)
			}
			fields := warnings[0].ContextMap()
			uses, _ := fields["client_ip_used_by"].([]any)
			var got []string
			for _, u := range uses {
				got = append(got, u.(string))
			}
			want := slices.Clone(tc.uses)
			for i, u := range want {
				if u == "limit z" {
					want[i] = "limit " + rl.Zone
				}
			}
			if !slices.Equal(got, want) || fields["fix"] != spoofableKeyFix || fields["zone"] != rl.Zone {
				t.Errorf("warning fields = %v, want client_ip_used_by %q, the zone and the fix", fields, want)
			}
		})
	}
}

// validName turns a test's name into a zone name.
func validName(s string) string {
	b := []byte(s)
	for i, c := range b {
		if !validZoneName(string(c)) {
			b[i] = '_'
		}
	}
	return string(b)
}

// One warning per server: of two handlers in one server, the first to see a
// proxied request logs it and both mark their zones; a handler in another
// server warns for its own.
func TestSpoofableKeyOneWarningPerServer(t *testing.T) {
	t.Parallel()
	srv1, srv2 := &caddyhttp.Server{}, &caddyhttp.Server{}
	a, _ := provisionHandlerIn(t, inServer(srv1), "proxy_per_server_a", 100, true)
	b, _ := provisionHandlerIn(t, inServer(srv1), "proxy_per_server_b", 100, true)
	c, _ := provisionHandlerIn(t, inServer(srv2), "proxy_per_server_c", 100, true)
	core, logs := observer.New(zapcore.InfoLevel)
	for _, rl := range []*RateLimit{a, b, c} {
		rl.logger = zap.New(core)
	}
	for range 3 {
		for _, rl := range []*RateLimit{a, b, c} {
			serveVars(t, rl, viaProxy("198.51.100.8", true))
		}
	}
	var zones []any
	for _, w := range logs.FilterMessage(spoofableKeyMsg).All() {
		zones = append(zones, w.ContextMap()["zone"])
	}
	if !slices.Equal(zones, []any{"proxy_per_server_a", "proxy_per_server_c"}) {
		t.Errorf("warnings for zones %v, want one per server: proxy_per_server_a, proxy_per_server_c", zones)
	}
	for _, rl := range []*RateLimit{a, b, c} {
		if !rl.zone.spoofableKey() {
			t.Errorf("zone %s not flagged", rl.Zone)
		}
	}
}

// The zone's flag lasts while a handler holding it is affected: a reload
// into a strict server clears it when the old handler lets go, and a
// reload into a lax one sets it again at its first proxied request, with a
// warning of its own.
func TestSpoofableKeyRecomputedOnReload(t *testing.T) {
	t.Parallel()
	const zone = "proxy_reload"
	old, _ := provisionHandlerIn(t, inServer(&caddyhttp.Server{}), zone, 100, true)
	serveVars(t, old, viaProxy("198.51.100.9", true))
	strict, _ := provisionHandlerIn(t, inServer(&caddyhttp.Server{TrustedProxiesStrict: 1}), zone, 100, true)
	if !strict.zone.spoofableKey() {
		t.Fatal("zone not flagged while the old handler holds it")
	}
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	serveVars(t, strict, viaProxy("203.0.113.9", true))
	if strict.zone.spoofableKey() {
		t.Fatal("zone flagged with only a strict server's handler holding it")
	}
	lax, _ := provisionHandlerIn(t, inServer(&caddyhttp.Server{}), zone, 100, true)
	logs := observe(lax)
	if strict.Cleanup() != nil || lax.zone.spoofableKey() {
		t.Fatal("zone flagged before the new handler saw a proxied request")
	}
	serveVars(t, lax, viaProxy("198.51.100.9", false))
	serveVars(t, lax, viaProxy("198.51.100.9", true))
	if !lax.zone.spoofableKey() || logs.FilterMessage(spoofableKeyMsg).Len() != 1 {
		t.Fatalf("after a proxied request to the lax config: flagged %t, %d warnings; want flagged, 1", lax.zone.spoofableKey(), logs.FilterMessage(spoofableKeyMsg).Len())
	}
}

// fromPeer tells a client IP that is the peer's address, as Caddy writes
// both, from one a header gave.
func TestFromPeer(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		remoteAddr, ip string
		want           bool
	}{
		{"203.0.113.9:50000", "203.0.113.9", true},
		{"[2001:db8::1]:50000", "2001:db8::1", true},
		{"[::ffff:203.0.113.9]:50000", "::ffff:203.0.113.9", true},
		{"203.0.113.90:50000", "203.0.113.9", false},
		{"203.0.113.9:50000", "203.0.113.90", false},
		{"127.0.0.1:50000", "198.51.100.7", false},
		{"[2001:db8::1]:50000", "2001:db8::", false},
		{"[2001:db8::1]:50000", "2001:db8::1]", false},
		{"[fe80::1%eth0]:50000", "fe80::1", false}, // asked: a look-up, not a wrong answer
		{"@", "203.0.113.9", false},
		{"203.0.113.9", "203.0.113.9", false},
		{"", "", false},
	} {
		if got := fromPeer(tc.remoteAddr, tc.ip); got != tc.want {
			t.Errorf("fromPeer(%q, %q) = %t, want %t", tc.remoteAddr, tc.ip, got, tc.want)
		}
	}
	// A request through a trusted proxy that named no client has the
	// proxy's address as its client IP: no client chose it, and it does
	// not warn; the next one that names a client does.
	rl, _ := provisionHandlerIn(t, inServer(&caddyhttp.Server{}), "proxy_from_peer", 100, true)
	logs := observe(rl)
	serveVars(t, rl, viaProxy("192.0.2.1", true)) // httptest's peer
	if logs.FilterMessage(spoofableKeyMsg).Len() != 0 || rl.zone.spoofableKey() {
		t.Fatal("a proxied request keyed by the proxy's own address warned")
	}
	serveVars(t, rl, viaProxy("198.51.100.7", true))
	if logs.FilterMessage(spoofableKeyMsg).Len() != 1 || !rl.zone.spoofableKey() {
		t.Fatal("a proxied request keyed by a header's address did not warn")
	}
}
