package tests

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// redisZoneSite is a site with one Redis zone, max 3 per 60s window, keyed
// by client IP (taken from a trusted X-Forwarded-For). extra is added to the
// store block.
func redisZoneSite(zone, addr, extra string) string {
	return fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		window 60
		max 3
		store redis {
			address %s
			%s
		}
	}
	respond "ok"
}`, zone, addr, extra)
}

// zoneSummary returns the zone's entry in GET /rate_limit/.
func zoneSummary(t *testing.T, name string) map[string]any {
	t.Helper()
	var zones []map[string]any
	adminJSON(t, "/rate_limit/", &zones)
	for _, z := range zones {
		if z["name"] == name {
			return z
		}
	}
	t.Fatalf("GET /rate_limit/ = %v: no zone %q", zones, name)
	return nil
}

// The admin API on a Redis zone: the zone list shows the store and its
// health, the listing reads the counters from Redis busiest first with its
// filters and paging, and a DELETE unblocks a limited client at once, its
// in-process "refused until reset" entry included.
func TestRedisAdminAPI(t *testing.T) {
	srv := redistest.Start(t)
	const zone = "e2e-redis-admin"
	s := startCaddy(t, trustLoopback, redisZoneSite(zone, srv.Addr, e2eTimeout))
	// Requests per IP: admitted min(n, 3), refused the rest.
	sendTraffic(t, s, map[string]int{"203.0.113.1": 5, "203.0.113.10": 6, "203.0.113.2": 2, "203.0.113.3": 2, "198.51.100.7": 1})

	t.Run("zones", func(t *testing.T) {
		z := zoneSummary(t, zone)
		want := map[string]any{"status": "active", "enabled": true, "store": "redis", "health": "HEALTHY",
			"algorithm": "fixed", "window_seconds": 60.0, "max": 3.0, "tracked_keys": 5.0, "rejected_total": 5.0}
		for k, v := range want {
			if z[k] != v {
				t.Errorf("%s = %v, want %v (zone %v)", k, z[k], v, z)
			}
		}
		if _, ok := z["hashed_keys"]; ok {
			t.Errorf("hashed_keys = %v, want it absent without hash_keys", z["hashed_keys"])
		}
	})

	t.Run("listing", func(t *testing.T) {
		checkListing(t, zone, []listingCase{
			{"", 5, "203.0.113.10 203.0.113.1 203.0.113.2 203.0.113.3 198.51.100.7"},
			{"?limited=true", 2, "203.0.113.10 203.0.113.1"},
			{"?limited=false", 5, "203.0.113.10 203.0.113.1 203.0.113.2 203.0.113.3 198.51.100.7"},
			{"?q=203.0.113.", 4, "203.0.113.10 203.0.113.1 203.0.113.2 203.0.113.3"},
			{"?q=203.0.113.1", 2, "203.0.113.10 203.0.113.1"},
			{"?q=192.", 0, ""},
			{"?offset=1&limit=2", 5, "203.0.113.1 203.0.113.2"},
			{"?offset=4&limit=2", 5, "198.51.100.7"},
			{"?offset=5", 5, ""},
			{"?limited=true&q=203.0.113.10", 1, "203.0.113.10"},
			{"?limited=true&offset=1&limit=1", 2, "203.0.113.1"},
		})

		var all keyList
		adminJSON(t, "/rate_limit/"+zone, &all)
		want := map[string]struct {
			count, refused, remaining int
			limited                   bool
		}{
			"203.0.113.10": {3, 3, 0, true},
			"203.0.113.1":  {3, 2, 0, true},
			"203.0.113.2":  {2, 0, 1, false},
			"203.0.113.3":  {2, 0, 1, false},
			"198.51.100.7": {1, 0, 2, false},
		}
		now := time.Now().Unix()
		for _, k := range all.Keys {
			w := want[k.Key]
			if k.Count != w.count || k.Refused != w.refused || k.Remaining != w.remaining || k.Limited != w.limited {
				t.Errorf("%s: count %d refused %d remaining %d limited %t, want %d %d %d %t",
					k.Key, k.Count, k.Refused, k.Remaining, k.Limited, w.count, w.refused, w.remaining, w.limited)
			}
			if k.Reset <= now || k.Reset > now+61 {
				t.Errorf("%s: reset %d, want within the 60s window after %d", k.Key, k.Reset, now)
			}
		}
		if all.Limit != 100 || all.Offset != 0 {
			t.Errorf("default page: offset %d limit %d, want 0 and 100", all.Offset, all.Limit)
		}
		if _, body := admin(t, http.MethodGet, "/rate_limit/"+zone+"?q=192."); !strings.Contains(body, `"keys":[]`) {
			t.Errorf("empty page = %s, want \"keys\":[]", body)
		}
	})

	t.Run("delete unblocks", func(t *testing.T) {
		// Refused now: from the in-process cache, without asking Redis.
		resp, _ := s.get("/", "X-Forwarded-For", "203.0.113.1")
		wantStatus(t, resp, http.StatusTooManyRequests)
		status, body := admin(t, http.MethodDelete, unblockPath(t, zone, "203.0.113.1"))
		if status != http.StatusOK || !strings.Contains(body, `"forgotten":true`) {
			t.Fatalf("DELETE: %d %s, want 200 forgotten", status, body)
		}
		for i := 1; i <= 3; i++ {
			resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.1")
			wantStatus(t, resp, http.StatusOK)
			wantHeader(t, resp, "X-RateLimit-Remaining", fmt.Sprint(3-i))
		}
		resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.1")
		wantStatus(t, resp, http.StatusTooManyRequests)
		// The other limited client stays limited.
		resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.10")
		wantStatus(t, resp, http.StatusTooManyRequests)

		// A second DELETE of a key no longer tracked is a 404.
		if status, body := admin(t, http.MethodDelete, "/rate_limit/"+zone+"?key=192.0.2.99"); status != http.StatusNotFound || !strings.Contains(body, "not tracked") {
			t.Errorf("DELETE of an untracked key: %d %s, want 404 not tracked", status, body)
		}

		// An IPv6 client is keyed by its /64, a key with a slash in it.
		for i := range 4 {
			resp, _ = s.get("/", "X-Forwarded-For", fmt.Sprintf("2001:db8::%d", i+1))
		}
		wantStatus(t, resp, http.StatusTooManyRequests)
		if status, body := admin(t, http.MethodDelete, unblockPath(t, zone, "2001:db8::/64")); status != http.StatusOK {
			t.Fatalf("DELETE of an IPv6 prefix: %d %s", status, body)
		}
		resp, _ = s.get("/", "X-Forwarded-For", "2001:db8::99")
		wantStatus(t, resp, http.StatusOK)
	})
}

// hmacHex is the hash a Redis store with hash_keys secret writes for key.
func hmacHex(secret, key string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(key))
	return hex.EncodeToString(m.Sum(nil))
}

// With hash_keys the admin API shows hashes, never IPs, says so, and a
// DELETE takes either the client IP or its hash.
func TestRedisAdminHashedKeys(t *testing.T) {
	srv := redistest.Start(t)
	const zone, secret = "e2e-redis-hashed", "s3cret-for-tests"
	s := startCaddy(t, trustLoopback, redisZoneSite(zone, srv.Addr, "hash_keys "+secret+"\n\t\t\t"+e2eTimeout))
	sendTraffic(t, s, map[string]int{"203.0.113.21": 5, "203.0.113.22": 4, "198.51.100.23": 1})
	h21, h22, h23 := hmacHex(secret, "203.0.113.21"), hmacHex(secret, "203.0.113.22"), hmacHex(secret, "198.51.100.23")

	z := zoneSummary(t, zone)
	if z["store"] != "redis" || z["health"] != "HEALTHY" || z["hashed_keys"] != true || z["tracked_keys"] != 3.0 {
		t.Errorf("zone = %v, want store redis, health HEALTHY, hashed_keys true, tracked_keys 3", z)
	}

	var got keyList
	adminJSON(t, "/rate_limit/"+zone, &got)
	if !got.HashedKeys || got.Total != 3 || len(got.Keys) != 3 {
		t.Fatalf("listing = %+v, want hashed_keys true and 3 keys", got)
	}
	// 203.0.113.21 and .22 both have 3 admitted, so the refusals rank them.
	wantKeys := []keyInfo{
		{Key: h21, Policy: zone, Count: 3, Refused: 2, Remaining: 0, Limited: true, Unblock: "/rate_limit/" + zone + "?key=" + h21},
		{Key: h22, Policy: zone, Count: 3, Refused: 1, Remaining: 0, Limited: true, Unblock: "/rate_limit/" + zone + "?key=" + h22},
		{Key: h23, Policy: zone, Count: 1, Refused: 0, Remaining: 2, Limited: false, Unblock: "/rate_limit/" + zone + "?key=" + h23},
	}
	for i, w := range wantKeys {
		k := got.Keys[i]
		k.Reset = 0
		if k != w {
			t.Errorf("key %d = %+v, want %+v", i, k, w)
		}
		if strings.Contains(k.Key, ".") {
			t.Errorf("key %d = %q: an IP in the listing of a hashed zone", i, k.Key)
		}
	}
	if _, body := admin(t, http.MethodGet, "/rate_limit/"+zone); strings.Contains(body, "203.0.113.") || strings.Contains(body, "198.51.100.") {
		t.Errorf("listing holds a client IP: %s", body)
	}
	var byPrefix keyList
	adminJSON(t, "/rate_limit/"+zone+"?q="+h22[:10], &byPrefix)
	if byPrefix.Total != 1 || len(byPrefix.Keys) != 1 || byPrefix.Keys[0].Key != h22 {
		t.Errorf("q=%s: %+v, want only %s", h22[:10], byPrefix, h22)
	}

	// The offenders of the last five minutes are listed by hash too, with
	// their live state in Redis.
	if _, body := admin(t, http.MethodGet, "/rate_limit/"+zone+"?sort=recent_refusals"); strings.Contains(body, "203.0.113.") {
		t.Errorf("offenders hold a client IP: %s", body)
	}
	var recent struct {
		Total int `json:"total"`
		Keys  []struct {
			Key            string `json:"key"`
			Count          int    `json:"count"`
			RecentRefusals int    `json:"recent_refusals"`
		} `json:"keys"`
	}
	adminJSON(t, "/rate_limit/"+zone+"?sort=recent_refusals", &recent)
	if recent.Total != 2 || recent.Keys[0].Key != h21 || recent.Keys[0].RecentRefusals != 2 || recent.Keys[0].Count != 3 || recent.Keys[1].Key != h22 {
		t.Errorf("offenders = %+v, want %s (2 refusals, count 3) then %s", recent, h21, h22)
	}

	// DELETE by the raw client IP unblocks it.
	resp, _ := s.get("/", "X-Forwarded-For", "203.0.113.21")
	wantStatus(t, resp, http.StatusTooManyRequests)
	if status, body := admin(t, http.MethodDelete, "/rate_limit/"+zone+"?key=203.0.113.21"); status != http.StatusOK {
		t.Fatalf("DELETE by IP: %d %s", status, body)
	}
	resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.21")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "X-RateLimit-Remaining", "2")

	// DELETE by the hash the listing shows unblocks too.
	resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.22")
	wantStatus(t, resp, http.StatusTooManyRequests)
	if status, body := admin(t, http.MethodDelete, "/rate_limit/"+zone+"?key="+h22); status != http.StatusOK {
		t.Fatalf("DELETE by hash: %d %s", status, body)
	}
	resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.22")
	wantStatus(t, resp, http.StatusOK)
	wantHeader(t, resp, "X-RateLimit-Remaining", "2")

	adminJSON(t, "/rate_limit/"+zone+"?limited=true", &got)
	if got.Total != 0 || len(got.Keys) != 0 {
		t.Errorf("limited keys after both DELETEs: %+v, want none", got)
	}
}

// The store health gauge on Caddy's /metrics follows Redis: 1 while it is
// up, 0 once the zone is DEGRADED after Redis died (with the requests decided
// without it, by the local fallback, counted as degraded_allowed), 1 again
// soon after Redis is back.
func TestRedisMetricsStoreHealth(t *testing.T) {
	srv := redistest.Start(t)
	const zone = "e2e-redis-metrics"
	s := startCaddy(t, trustLoopback, redisZoneSite(zone, srv.Addr, "timeout 200ms"))
	healthy := series("store_healthy", zone, "")
	storeErrors := series("requests_total", zone, "degraded_allowed")
	allowed := series("requests_total", zone, "allowed")

	for range 2 {
		resp, _ := s.get("/", "X-Forwarded-For", "192.0.2.50")
		wantStatus(t, resp, http.StatusOK)
	}
	m := scrape(t, zone)
	if m[healthy] != 1 || m[allowed] != 2 || m[storeErrors] != 0 {
		t.Fatalf("with redis up: healthy %v allowed %v degraded_allowed %v, want 1, 2, 0 (%v)", m[healthy], m[allowed], m[storeErrors], m)
	}

	srv.Stop()
	// Each request fails over to the local store (on_error local), so
	// every client is still admitted; after 3 failures the zone degrades.
	deadline := time.Now().Add(10 * time.Second)
	sent := 0
	for zoneSummary(t, zone)["health"] != "DEGRADED" {
		if time.Now().After(deadline) {
			t.Fatalf("zone not DEGRADED %d requests after redis stopped: %v", sent, zoneSummary(t, zone))
		}
		sent++
		resp, _ := s.get("/", "X-Forwarded-For", fmt.Sprintf("192.0.2.%d", 100+sent))
		wantStatus(t, resp, http.StatusOK)
	}
	if sent < 3 {
		t.Errorf("DEGRADED after %d requests, want at least 3 failures first", sent)
	}
	// Two more, decided locally without waiting on Redis.
	for i := range 2 {
		resp, _ := s.get("/", "X-Forwarded-For", fmt.Sprintf("192.0.2.%d", 200+i))
		wantStatus(t, resp, http.StatusOK)
	}
	m = scrape(t, zone)
	if m[healthy] != 0 {
		t.Errorf("redis down, zone DEGRADED: store_healthy = %v, want 0", m[healthy])
	}
	if m[storeErrors] != float64(sent+2) || m[allowed] != 2 {
		t.Errorf("redis down: degraded_allowed %v allowed %v, want %d and 2", m[storeErrors], m[allowed], sent+2)
	}

	srv.Restart()
	start := time.Now()
	deadline = start.Add(10 * time.Second)
	for {
		m = scrape(t, zone)
		if m[healthy] == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("redis restarted 10s ago, store_healthy still %v (zone %v)", m[healthy], zoneSummary(t, zone))
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("store_healthy back to 1 %s after redis restarted", time.Since(start).Round(time.Millisecond))
	if h := zoneSummary(t, zone)["health"]; h != "HEALTHY" {
		t.Errorf("health = %v after the gauge read 1, want HEALTHY", h)
	}
	// Decisions go to Redis again.
	resp, _ := s.get("/", "X-Forwarded-For", "192.0.2.50")
	wantStatus(t, resp, http.StatusOK)
	m = scrape(t, zone)
	if m[allowed] != 3 || m[storeErrors] != float64(sent+2) {
		t.Errorf("redis back: allowed %v degraded_allowed %v, want 3 and %d", m[allowed], m[storeErrors], sent+2)
	}
}
