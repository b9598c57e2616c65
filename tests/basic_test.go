package tests

import (
	"net/http"
	"strconv"
	"testing"
	"time"
)

// Six quick requests with max 5: five 200s counting down, then a 429 with
// Retry-After.
func TestSixRequestsFiveAdmitted(t *testing.T) {
	s := startCaddy(t, "", `
:$PORT {
	rate_limit {
		zone six
		window 60
		max 5
	}
	respond "ok"
}`)
	before := time.Now().Unix()
	for i := 1; i <= 5; i++ {
		resp, body := s.get("/")
		wantStatus(t, resp, http.StatusOK)
		if body != "ok" {
			t.Errorf("request %d: body = %q, want ok", i, body)
		}
		wantHeader(t, resp, "X-RateLimit-Limit", "5")
		wantHeader(t, resp, "X-RateLimit-Remaining", strconv.Itoa(5-i))
		reset, err := strconv.ParseInt(resp.Header.Get("X-RateLimit-Reset"), 10, 64)
		if err != nil || reset < before+59 || reset > time.Now().Unix()+61 {
			t.Errorf("request %d: X-RateLimit-Reset = %q, want about %d", i, resp.Header.Get("X-RateLimit-Reset"), before+60)
		}
		if ra := resp.Header.Get("Retry-After"); ra != "" {
			t.Errorf("request %d: Retry-After = %q on an admitted request", i, ra)
		}
	}
	resp, _ := s.get("/")
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "X-RateLimit-Limit", "5")
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	if err != nil || ra < 1 || ra > 60 {
		t.Errorf("Retry-After = %q, want 1..60", resp.Header.Get("Retry-After"))
	}
}
