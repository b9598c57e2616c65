package tests

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// A key refused on two instances sharing one Redis, unblocked through one
// instance's admin API, is admitted by the other within a second, though the
// other had cached its refusal for the rest of the minute.
func TestFleetUnblockEverywhere(t *testing.T) {
	srv := redistest.Start(t)
	site := fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone e2e-fleet-unblock
		window 60
		max 1
		key {http.request.header.X-Client}
		store redis {
			address %s
		}
	}
	respond "ok"
}`, srv.Addr)
	a := startCaddy(t, "", site)
	b := startCaddyProcess(t, site)
	get := func(base string) int {
		req, _ := http.NewRequest(http.MethodGet, base+"/", nil)
		req.Header.Set("X-Client", "banned")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := get(a.Base); got != http.StatusOK {
		t.Fatalf("first request: %d", got)
	}
	for _, base := range []string{a.Base, b, b, a.Base} {
		if got := get(base); got != http.StatusTooManyRequests {
			t.Fatalf("%s: %d, want 429", base, got)
		}
	}
	if status, body := admin(t, http.MethodDelete, "/rate_limit/e2e-fleet-unblock?key=key:banned"); status != http.StatusOK {
		t.Fatalf("unblock: %d %s", status, body)
	}
	start := time.Now()
	for get(b) != http.StatusOK {
		if time.Since(start) > time.Second {
			t.Fatal("the other instance still refuses the key a second after the unblock")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("the other instance admitted the key %s after the unblock", time.Since(start).Round(time.Millisecond))
}
