package ratelimit

import "testing"

func TestClientIPKey(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ip     string
		prefix int
		want   string
	}{
		{"203.0.113.7", 64, "203.0.113.7"},
		{"::ffff:203.0.113.7", 64, "203.0.113.7"},
		{"2001:db8:1:2:3:4:5:6", 64, "2001:db8:1:2::/64"},
		{"2001:db8:1:2::9", 64, "2001:db8:1:2::/64"},
		{"2001:db8:1:2:3:4:5:6", 48, "2001:db8:1::/48"},
		{"2001:db8:1:2:3:4:5:6", 128, "2001:db8:1:2:3:4:5:6"},
		{"fe80::1%eth0", 64, "fe80::/64"},
		{"@", 64, "@"},
	} {
		if got := clientIPKey(tc.ip, tc.prefix); got != tc.want {
			t.Errorf("clientIPKey(%q, %d) = %q, want %q", tc.ip, tc.prefix, got, tc.want)
		}
	}
}
