package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// FuzzUnmarshalCaddyfile checks that no rate_limit block crashes the parser,
// and that whatever it accepts also passes Validate: a bad value must fail
// at adapt, never later.
func FuzzUnmarshalCaddyfile(f *testing.F) {
	// Seeds: every option, the aliases, and values at their bounds.
	f.Add("zone api\nwindow 1m\nmax 300\nmax_tracked 1000\nkey {http.request.header.X-Key}")
	f.Add("windowS 60\nmaxTracked 100000\nipv6_prefix 128\nheaders both\ngc_interval 5m\nenabled false")
	f.Add("window 1\nmax 1\nipv6_prefix 1\nheaders none")
	f.Add("window 999999999999\nmax 2147483647") // a window past the bound: refused
	f.Add("window 31622400\nzone a.b:c-d_e")     // the longest window
	f.Fuzz(func(t *testing.T, block string) {
		var rl RateLimit
		input := "rate_limit {\n" + block + "\n}"
		if err := rl.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input)); err != nil {
			return
		}
		if err := rl.check(); err != nil {
			t.Fatalf("parser accepted %q but Validate says %v", block, err)
		}
		if w := time.Duration(rl.Window); w < 0 || w > MaxWindow {
			t.Fatalf("parser accepted %q with window %s out of range", block, w)
		}
	})
}

// FuzzClientIPKey checks that a key is derived from any client address
// without a crash, that an IPv4 address or anything that is not an IP
// address is its own key, that IPv6 keys never depend on the bits past the
// prefix, and that the result is never empty for a non-empty address.
func FuzzClientIPKey(f *testing.F) {
	f.Add("203.0.113.9", 64)
	f.Add("2001:db8::1", 64)
	f.Add("::ffff:192.0.2.1", 48)
	f.Add("fe80::1%eth0", 10)
	f.Add("not an ip", 64)
	f.Fuzz(func(t *testing.T, ip string, prefix int) {
		prefix = 1 + (prefix&0x7fffffff)%128
		key := clientIPKey(ip, prefix)
		if ip != "" && key == "" {
			t.Fatalf("clientIPKey(%q, %d) is empty", ip, prefix)
		}
		addr, err := netip.ParseAddr(ip)
		if (err != nil || addr.Is4()) && key != ip {
			t.Fatalf("clientIPKey(%q, %d) = %q, want the address as it is", ip, prefix, key)
		}
		if err != nil || !addr.Is6() || addr.Is4In6() || prefix == 128 {
			return
		}
		// Flip the last bit: same network, same key.
		b := addr.As16()
		b[15] ^= 1
		if other := clientIPKey(netip.AddrFrom16(b).String(), prefix); other != key {
			t.Fatalf("%q and its neighbour got keys %q and %q", ip, key, other)
		}
		if !strings.Contains(key, "/") {
			t.Fatalf("IPv6 key %q has no prefix length", key)
		}
	})
}

// FuzzAdminRequest sends any path and query to the admin API: it never
// crashes, every error is a caddy.APIError (which Caddy answers as JSON),
// and only the documented forms succeed: the zone list, a zone's listing,
// and an unblock with its key in the query.
func FuzzAdminRequest(f *testing.F) {
	f.Add("DELETE", "/rate_limit/fuzz-admin", "key=key%3A%2F..%2F..%2Fconfig%2F")
	f.Add("DELETE", "/rate_limit/fuzz-admin/key:%2F%2E%2E%2Fconfig%2F", "")
	f.Add("GET", "/rate_limit/fuzz-admin", "q=203.0.113.%&limited=true;")
	f.Add("GET", "/rate_limit/fuzz-admin", "offset=1;limit=1&limit=2")
	f.Add("GET", "/rate_limit/", "")
	f.Add("GET", "/rate_limit", "x")
	f.Add("GET", "/rate_limit/%2e%2e", "")
	rl, _ := provisionHandler(f, "fuzz-admin", 1, true)
	serve(f, rl, "192.0.2.1")
	serve(f, rl, "192.0.2.1")
	routes := AdminAPI{}.Routes()
	f.Fuzz(func(t *testing.T, method, path, query string) {
		u := &url.URL{Path: "/", RawQuery: query}
		if rest, ok := strings.CutPrefix(path, "/"); ok {
			u.RawPath, u.Path = path, "/"+rest
			if p, err := url.PathUnescape(path); err == nil {
				u.Path = p
			}
		}
		if method == "" || strings.ContainsAny(method, " \t\r\n") {
			method = http.MethodGet
		}
		r := &http.Request{Method: method, URL: u, Header: http.Header{}}
		r = r.WithContext(context.Background())
		w := httptest.NewRecorder()
		err := routes[0].Handler.ServeHTTP(w, r)
		if err != nil {
			var aerr caddy.APIError
			if !errors.As(err, &aerr) || aerr.HTTPStatus < 400 || aerr.HTTPStatus > 599 {
				t.Fatalf("%s %s?%s: error %v is not an API error", method, path, query, err)
			}
			return
		}
		if w.Code != http.StatusOK || !json.Valid(w.Body.Bytes()) {
			t.Fatalf("%s %s?%s: status %d, body %q", method, path, query, w.Code, w.Body)
		}
		rest := strings.TrimPrefix(strings.TrimPrefix(u.EscapedPath(), "/rate_limit"), "/")
		if strings.Contains(rest, "/") {
			t.Fatalf("%s %s?%s succeeded with more than a zone in the path", method, path, query)
		}
	})
}

// FuzzCustomKey checks that every custom key is counted under a key that is
// printable, not longer than the bound, and the client's text as it is only
// when that text is printable.
func FuzzCustomKey(f *testing.F) {
	f.Add("alice")
	f.Add("\xff\xfe")
	f.Add("/../../../config/")
	f.Add("a\u202eb")
	f.Add(strings.Repeat("x", 129))
	f.Fuzz(func(t *testing.T, raw string) {
		k := customKey(raw)
		if !strings.HasPrefix(k, customKeyPrefix) || !printable(k) || len(k) > len(customKeyPrefix)+maxCustomKeyLen {
			t.Fatalf("customKey(%q) = %q", raw, k)
		}
		if kept := k == customKeyPrefix+raw; kept != (printable(raw) && len(raw) <= maxCustomKeyLen) {
			t.Fatalf("customKey(%q) = %q: kept %t", raw, k, kept)
		}
		if utf8.ValidString(raw) && strings.ContainsFunc(raw, unicode.IsControl) && k == customKeyPrefix+raw {
			t.Fatalf("customKey(%q) kept a control character", raw)
		}
	})
}
