package ratelimit

import (
	"net/netip"
	"strings"
	"testing"
	"time"

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
		if err := rl.Validate(); err != nil {
			t.Fatalf("parser accepted %q but Validate says %v", block, err)
		}
		if w := time.Duration(rl.Window); w < 0 || w > MaxWindow {
			t.Fatalf("parser accepted %q with window %s out of range", block, w)
		}
	})
}

// FuzzClientIPKey checks that a key is derived from any client address
// without a crash, that IPv6 keys never depend on the bits past the prefix,
// and that the result is never empty for a non-empty address.
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
