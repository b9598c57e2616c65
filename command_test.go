package ratelimit

import (
	"testing"
	"time"
)

// Durations print as people write them, in the CLI's tables.
func TestHumanDuration(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		d    time.Duration
		want string
	}{
		{-time.Second, "0s"},
		{0, "0s"},
		{999 * time.Millisecond, "0s"},
		{time.Second, "1s"},
		{time.Minute, "1m"},
		{90 * time.Second, "1m30s"},
		{15 * time.Minute, "15m"},
		{time.Hour + 30*time.Minute, "1h30m"},
		{time.Hour + time.Second, "1h1s"},
		{24 * time.Hour, "24h"},
	} {
		if got := humanDuration(tt.d); got != tt.want {
			t.Errorf("humanDuration(%v) = %q, want %q", tt.d, got, tt.want)
		}
	}
}
