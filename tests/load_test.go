package tests

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestListingUnderLoad measures what listing a 100,000-key zone costs the
// requests served meanwhile: it fills a zone with 100,000 clients, then
// serves steady traffic for a while without listings and for a while with
// listings running back to back, and reports the latency percentiles of
// both. It takes about half a minute, so it runs only when RATE_LIMIT_LOAD
// is set:
//
//	RATE_LIMIT_LOAD=1 go test -run TestListingUnderLoad -v ./tests/
func TestListingUnderLoad(t *testing.T) {
	if os.Getenv("RATE_LIMIT_LOAD") == "" {
		t.Skip("set RATE_LIMIT_LOAD=1 to measure request latency while 100,000-key listings run")
	}
	const keys = 100_000
	phase := 8 * time.Second
	s := startCaddy(t, trustLoopback, `
:$PORT {
	rate_limit {
		zone e2e-load
		window 1h
		max 1000000
		max_tracked 200000
	}
	respond "ok"
}`)
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	do := func(url, ip string) (int, error) {
		req, err := http.NewRequest(http.MethodGet, url, nil)
		if err != nil {
			return 0, err
		}
		if ip != "" {
			req.Header.Set("X-Forwarded-For", ip)
		}
		resp, err := hc.Do(req)
		if err != nil {
			return 0, err
		}
		defer resp.Body.Close()
		_, err = io.Copy(io.Discard, resp.Body)
		return resp.StatusCode, err
	}
	ipOf := func(i int) string { return fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&255, i&255) }

	start := time.Now()
	var wg sync.WaitGroup
	var failed atomic.Int64
	for w := range 8 {
		wg.Go(func() {
			for i := w; i < keys; i += 8 {
				if code, err := do(s.Base+"/", ipOf(i)); err != nil || code != http.StatusOK {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if failed.Load() > 0 {
		t.Fatalf("%d requests failed while filling the zone", failed.Load())
	}
	var zones []map[string]any
	adminJSON(t, "/rate_limit/", &zones)
	for _, z := range zones {
		if z["name"] == "e2e-load" && z["tracked_keys"] != float64(keys) {
			t.Fatalf("zone tracks %v keys, want %d", z["tracked_keys"], keys)
		}
	}
	t.Logf("filled %d keys in %s", keys, time.Since(start).Round(time.Millisecond))

	// serveFor sends requests from 4 clients for d and returns their
	// latencies; while listing is set, a fifth client lists the zone back
	// to back, alternating the first page and the deepest page the listing
	// allows (offset+limit at MaxListDepth, 10000).
	serveFor := func(d time.Duration, listing bool) (lat, lists []time.Duration) {
		var mu sync.Mutex
		stop := make(chan struct{})
		var wg sync.WaitGroup
		for w := range 4 {
			wg.Go(func() {
				var mine []time.Duration
				for i := 0; ; i++ {
					select {
					case <-stop:
						mu.Lock()
						lat = append(lat, mine...)
						mu.Unlock()
						return
					default:
					}
					t0 := time.Now()
					if code, err := do(s.Base+"/", ipOf((w*7919+i*31)%keys)); err != nil || code != http.StatusOK {
						failed.Add(1)
					}
					mine = append(mine, time.Since(t0))
				}
			})
		}
		if listing {
			wg.Go(func() {
				for i := 0; ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					path := "/rate_limit/e2e-load?limit=1000"
					if i%2 == 1 {
						path += "&offset=9000"
					}
					t0 := time.Now()
					if code, err := do(fmt.Sprintf("http://localhost:%d%s", adminPort, path), ""); err != nil || code != http.StatusOK {
						failed.Add(1)
					}
					lists = append(lists, time.Since(t0))
				}
			})
		}
		time.Sleep(d)
		close(stop)
		wg.Wait()
		return lat, lists
	}

	base, _ := serveFor(phase, false)
	loaded, lists := serveFor(phase, true)
	if failed.Load() > 0 {
		t.Fatalf("%d requests failed", failed.Load())
	}
	report := func(name string, lat []time.Duration) time.Duration {
		slices.Sort(lat)
		pct := func(p float64) time.Duration { return lat[min(int(float64(len(lat))*p), len(lat)-1)] }
		t.Logf("%-26s n=%-6d rps=%-6.0f p50=%-9s p90=%-9s p99=%-9s max=%s", name, len(lat),
			float64(len(lat))/phase.Seconds(), pct(0.50), pct(0.90), pct(0.99), lat[len(lat)-1])
		return pct(0.99)
	}
	if len(lists) == 0 || len(base) == 0 || len(loaded) == 0 {
		t.Fatalf("no figures: %d listings, %d and %d requests", len(lists), len(base), len(loaded))
	}
	report("requests, no listing", base)
	p99 := report("requests, listing running", loaded)
	slices.Sort(lists)
	t.Logf("%-26s n=%-6d p50=%-9s max=%s", "listings (1000 of 100k)", len(lists), lists[len(lists)/2], lists[len(lists)-1])
	if lists[len(lists)-1] > time.Second {
		t.Errorf("a listing of %d keys took %s, want well under a second", keys, lists[len(lists)-1])
	}
	if p99 > 250*time.Millisecond {
		t.Errorf("p99 of requests served while listings run = %s, want under 250ms", p99)
	}
}
