package tests

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// Concurrent successful logins (status 200, outside count_status) get a key banned.
func TestCountStatusNoBanOnSuccess(t *testing.T) {
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(300 * time.Millisecond)
		w.WriteHeader(http.StatusOK)
	}))
	defer backend.Close()
	s := startCaddy(t, trustLoopback, fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone e2e-login-ban-success
		window 60
		max 3
		count_status 401
		ban 10m
	}
	reverse_proxy %s
}`, backend.Listener.Addr()))
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.50") })
	}
	wg.Wait()
	time.Sleep(100 * time.Millisecond)
	resp := request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.50")
	t.Logf("after 4 concurrent 200s: %d Retry-After=%s", resp.StatusCode, resp.Header.Get("Retry-After"))
	if resp.StatusCode != http.StatusOK {
		t.Errorf("a key with no 401 at all is banned (status %d, Retry-After %s)", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}
