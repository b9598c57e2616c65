package ratelimit

import "testing"

// The KEYS column of caddy rate-limit zones shows a Redis zone's count with
// its age when it is not fresh, and a partial count as a lower bound, never
// as a bare number.
func TestTrackedText(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		zone ZoneInfo
		want string
	}{
		{ZoneInfo{TrackedKeys: 3}, "3"},
		{ZoneInfo{TrackedKeys: 462660, TrackedKeysAgeSeconds: 12}, "462660 (12s ago)"},
		{ZoneInfo{TrackedKeys: 0, TrackedKeysPartial: true}, ">=0"},
		{ZoneInfo{TrackedKeys: 120500, TrackedKeysPartial: true}, ">=120500"},
	} {
		if got := trackedText(tc.zone); got != tc.want {
			t.Errorf("trackedText(%+v) = %q, want %q", tc.zone, got, tc.want)
		}
	}
}
