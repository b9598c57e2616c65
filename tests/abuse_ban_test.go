package tests

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
)

// Concurrent successful logins (status 200, outside count_status) get a key banned.
func TestCountStatusNoBanOnSuccess(t *testing.T) {
	// The backend holds each request until the test lets the three go,
	// so that the fourth arrives while three hold their units.
	arrived, release := make(chan struct{}, 4), make(chan struct{})
	backend := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
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
	var refused atomic.Int64
	send := func() {
		if request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.50").StatusCode == http.StatusTooManyRequests {
			refused.Add(1)
		}
	}
	for range 3 {
		wg.Go(send)
	}
	for range 3 {
		<-arrived
	}
	send() // the fourth, with three in flight
	close(release)
	wg.Wait()
	if refused.Load() != 1 {
		// The scenario needs a refusal while the other three hold units.
		t.Fatalf("%d of 4 requests refused, want 1 (3 held by requests in flight)", refused.Load())
	}
	resp := request(t, s.Base, "/", "X-Forwarded-For", "198.51.100.50")
	if resp.StatusCode != http.StatusOK {
		t.Errorf("a key with no 401 at all is banned (status %d, Retry-After %s)", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}
