package tests

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

// trustLoopback makes Caddy take the client IP from X-Forwarded-For when the
// peer is on a private network, as the test client on loopback is. It takes
// the header's leftmost address, so its zones are flagged spoofable_key.
const trustLoopback = `servers {
		trusted_proxies static private_ranges
	}`

// trustLoopbackStrict is trustLoopback with trusted_proxies_strict, as
// docs/security.md has it: the client IP is the header's rightmost address
// that is not a trusted proxy, and no zone is flagged.
const trustLoopbackStrict = `servers {
		trusted_proxies static private_ranges
		trusted_proxies_strict
	}`

// admin sends a request to the in-process Caddy's admin endpoint and returns
// the status and body.
func admin(t *testing.T, method, path string) (int, string) {
	t.Helper()
	status, _, body := adminDo(t, method, path)
	return status, body
}

// adminDo is admin, with the answer's headers.
func adminDo(t *testing.T, method, path string) (int, http.Header, string) {
	t.Helper()
	return adminSend(t, method, path, "")
}

// adminSend is adminDo with body as the request's body.
func adminSend(t *testing.T, method, path, body string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, fmt.Sprintf("http://localhost:%d%s", adminPort, path), strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	reply, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading %s %s: %v", method, path, err)
	}
	return resp.StatusCode, resp.Header, string(reply)
}

// wantPrivateJSON fails t unless h, the headers of an answer holding client
// keys (or an error about them), say JSON that no cache keeps and no
// browser sniffs.
func wantPrivateJSON(t *testing.T, what string, h http.Header) {
	t.Helper()
	if h.Get("Content-Type") != "application/json" || h.Get("Cache-Control") != "no-store" || h.Get("X-Content-Type-Options") != "nosniff" {
		t.Errorf("%s: Content-Type %q, Cache-Control %q, X-Content-Type-Options %q; want application/json, no-store, nosniff",
			what, h.Get("Content-Type"), h.Get("Cache-Control"), h.Get("X-Content-Type-Options"))
	}
}

// adminJSON sends a GET to the admin endpoint that must answer 200 and
// decodes the body into v.
func adminJSON(t *testing.T, path string, v any) {
	t.Helper()
	status, body := admin(t, http.MethodGet, path)
	if status != http.StatusOK {
		t.Fatalf("GET %s: status %d: %s", path, status, body)
	}
	if err := json.Unmarshal([]byte(body), v); err != nil {
		t.Fatalf("GET %s: decoding %q: %v", path, body, err)
	}
}

// keyInfo is one key as the listing shows it. The tests decode the wire
// format with their own types, so a change to the module's reply types that
// alters the JSON fails here.
type keyInfo struct {
	Key       string `json:"key"`
	Policy    string `json:"policy"`
	Count     int    `json:"count"`
	Refused   int    `json:"refused"`
	Remaining int    `json:"remaining"`
	Reset     int64  `json:"reset"`
	Limited   bool   `json:"limited"`
	Unblock   string `json:"unblock"`
	// BannedUntil is when the key's ban ends (Unix seconds), 0 if none.
	BannedUntil int64 `json:"banned_until"`
}

// keyList is the reply to GET /rate_limit/<zone>.
type keyList struct {
	Zone       string    `json:"zone"`
	Total      int       `json:"total"`
	Offset     int       `json:"offset"`
	Limit      int       `json:"limit"`
	HashedKeys bool      `json:"hashed_keys"`
	Keys       []keyInfo `json:"keys"`
}

// sendTraffic sends n requests per client IP and fails unless the first 3
// are admitted and the rest refused.
func sendTraffic(t *testing.T, s *server, traffic map[string]int) {
	t.Helper()
	for ip, n := range traffic {
		for i := range n {
			resp, _ := s.get("/", "X-Forwarded-For", ip)
			want := http.StatusOK
			if i >= 3 {
				want = http.StatusTooManyRequests
			}
			if resp.StatusCode != want {
				t.Fatalf("%s request %d: status %d, want %d", ip, i+1, resp.StatusCode, want)
			}
		}
	}
}

// listingCase is one listing query and the keys it must return, in order.
type listingCase struct {
	query string
	total int
	keys  string // space-separated
}

// checkListing runs each query against the zone's listing and compares the
// zone, the total and the keys in order.
func checkListing(t *testing.T, zone string, cases []listingCase) {
	t.Helper()
	for _, tc := range cases {
		var got keyList
		adminJSON(t, "/rate_limit/"+zone+tc.query, &got)
		if got.Zone != zone || got.Total != tc.total || got.keys() != tc.keys {
			t.Errorf("%q: zone %q total %d keys [%s], want zone %q total %d keys [%s]",
				tc.query, got.Zone, got.Total, got.keys(), zone, tc.total, tc.keys)
		}
	}
}

// unblockPath returns the unblock path the zone's listing gives for key,
// as an operator would copy it, and fails if the listing lacks the key.
func unblockPath(t *testing.T, zone, key string) string {
	t.Helper()
	var got keyList
	adminJSON(t, "/rate_limit/"+zone+"?limit=1000", &got)
	for _, k := range got.Keys {
		if k.Key == key {
			if !strings.HasPrefix(k.Unblock, "/rate_limit/"+zone+"?key=") {
				t.Fatalf("key %q: unblock %q, want /rate_limit/%s?key=…", key, k.Unblock, zone)
			}
			return k.Unblock
		}
	}
	t.Fatalf("zone %s does not list key %q: %+v", zone, key, got)
	return ""
}

func (l keyList) keys() string {
	ks := []string{}
	for _, k := range l.Keys {
		ks = append(ks, k.Key)
	}
	return strings.Join(ks, " ")
}

// Several clients behind a trusted proxy hit a zone; the admin endpoint
// lists them busiest first, filters and pages them, and a DELETE unblocks
// one at once.
func TestAdminAPI(t *testing.T) {
	s := startCaddy(t, trustLoopback, `
:$PORT {
	rate_limit /off/* {
		zone e2e-admin-off
		enabled false
	}
	rate_limit {
		zone e2e-admin
		window 60
		max 3
	}
	respond "ok"
}`)
	sendTraffic(t, s, map[string]int{"203.0.113.1": 5, "203.0.113.10": 4, "203.0.113.2": 2, "203.0.113.3": 2, "198.51.100.7": 1})

	t.Run("zones", func(t *testing.T) {
		var zones []map[string]any
		adminJSON(t, "/rate_limit/", &zones)
		byName := map[string]map[string]any{}
		for _, z := range zones {
			byName[z["name"].(string)] = z
		}
		on, off := byName["e2e-admin"], byName["e2e-admin-off"]
		if on == nil || off == nil {
			t.Fatalf("zones = %v, want e2e-admin and e2e-admin-off", zones)
		}
		want := map[string]any{"status": "active", "enabled": true, "store": "memory", "algorithm": "fixed",
			"window_seconds": 60.0, "max": 3.0, "tracked_keys": 5.0, "rejected_total": 3.0, "websocket_connections": 0.0}
		for k, v := range want {
			if on[k] != v {
				t.Errorf("e2e-admin %s = %v, want %v", k, on[k], v)
			}
		}
		if off["status"] != "disabled" || off["enabled"] != false || off["tracked_keys"] != 0.0 {
			t.Errorf("e2e-admin-off = %v, want disabled, enabled false, no keys", off)
		}
	})

	t.Run("private answers", func(t *testing.T) {
		for _, tc := range []struct {
			method, path string
			status       int
		}{
			{http.MethodGet, "/rate_limit/", http.StatusOK},
			{http.MethodGet, "/rate_limit/e2e-admin", http.StatusOK},
			{http.MethodGet, "/rate_limit/e2e-admin?sort=nope", http.StatusBadRequest},
			{http.MethodGet, "/rate_limit/no-such-zone", http.StatusNotFound},
			{http.MethodPost, "/rate_limit/e2e-admin", http.StatusMethodNotAllowed},
			{http.MethodDelete, "/rate_limit/e2e-admin?key=192.0.2.250", http.StatusNotFound},
		} {
			status, h, body := adminDo(t, tc.method, tc.path)
			if status != tc.status {
				t.Errorf("%s %s: %d %s, want %d", tc.method, tc.path, status, body, tc.status)
			}
			wantPrivateJSON(t, tc.method+" "+tc.path, h)
		}
	})

	t.Run("listing", func(t *testing.T) {
		checkListing(t, "e2e-admin", []listingCase{
			{"", 5, "203.0.113.1 203.0.113.10 203.0.113.2 203.0.113.3 198.51.100.7"},
			{"?limited=true", 2, "203.0.113.1 203.0.113.10"},
			{"?q=203.0.113.", 4, "203.0.113.1 203.0.113.10 203.0.113.2 203.0.113.3"},
			{"?q=203.0.113.1", 2, "203.0.113.1 203.0.113.10"},
			{"?q=192.", 0, ""},
			{"?offset=1&limit=2", 5, "203.0.113.10 203.0.113.2"},
			{"?offset=4&limit=2", 5, "198.51.100.7"},
			{"?offset=5", 5, ""},
			{"?limited=true&q=203.0.113.10", 1, "203.0.113.10"},
		})
		var top keyList
		adminJSON(t, "/rate_limit/e2e-admin?limit=1", &top)
		if k := top.Keys[0]; k.Count != 3 || k.Refused != 2 || k.Remaining != 0 || !k.Limited || k.Reset == 0 {
			t.Errorf("top key = %+v, want count 3, refused 2, remaining 0, limited, a reset", k)
		}
		if top.Limit != 1 || top.Offset != 0 {
			t.Errorf("page offset %d limit %d, want 0 and 1", top.Offset, top.Limit)
		}
		if _, body := admin(t, http.MethodGet, "/rate_limit/e2e-admin?q=192."); !strings.Contains(body, `"keys":[]`) {
			t.Errorf("empty page = %s, want \"keys\":[]", body)
		}
	})

	t.Run("errors", func(t *testing.T) {
		tests := []struct {
			method, path string
			status       int
			text         string
		}{
			{http.MethodGet, "/rate_limit/no-such-zone", http.StatusNotFound, `unknown rate limit zone \"no-such-zone\"`},
			{http.MethodDelete, "/rate_limit/no-such-zone?key=203.0.113.1", http.StatusNotFound, "unknown rate limit zone"},
			{http.MethodDelete, "/rate_limit/e2e-admin?key=192.0.2.99", http.StatusNotFound, "not tracked"},
			{http.MethodDelete, "/rate_limit/e2e-admin/203.0.113.1", http.StatusBadRequest, "a key goes in the query"},
			{http.MethodPost, "/rate_limit/", http.StatusMethodNotAllowed, "method POST not allowed"},
			{http.MethodPut, "/rate_limit/e2e-admin", http.StatusMethodNotAllowed, "method PUT not allowed"},
			{http.MethodGet, "/rate_limit/e2e-admin?limit=5000", http.StatusBadRequest, `invalid limit \"5000\"`},
			{http.MethodGet, "/rate_limit/e2e-admin?offset=x", http.StatusBadRequest, `invalid offset \"x\"`},
			{http.MethodGet, "/rate_limit/e2e-admin?limited=maybe", http.StatusBadRequest, `invalid limited \"maybe\"`},
		}
		for _, tt := range tests {
			status, body := admin(t, tt.method, tt.path)
			if status != tt.status || !strings.Contains(body, `"error":`) || !strings.Contains(body, tt.text) {
				t.Errorf("%s %s: %d %s, want %d with a JSON error mentioning %s", tt.method, tt.path, status, body, tt.status, tt.text)
			}
		}
	})

	t.Run("delete unblocks", func(t *testing.T) {
		resp, _ := s.get("/", "X-Forwarded-For", "203.0.113.1")
		wantStatus(t, resp, http.StatusTooManyRequests)
		if status, body := admin(t, http.MethodDelete, unblockPath(t, "e2e-admin", "203.0.113.1")); status != http.StatusOK {
			t.Fatalf("DELETE: %d %s", status, body)
		}
		resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.1")
		wantStatus(t, resp, http.StatusOK)
		wantHeader(t, resp, "X-RateLimit-Remaining", "2")
		// The other limited client stays limited.
		resp, _ = s.get("/", "X-Forwarded-For", "203.0.113.10")
		wantStatus(t, resp, http.StatusTooManyRequests)
		// An IPv6 client is keyed by its /64, a key with a slash in it.
		for i := range 4 {
			resp, _ = s.get("/", "X-Forwarded-For", fmt.Sprintf("2001:db8::%d", i+1))
		}
		wantStatus(t, resp, http.StatusTooManyRequests)
		if status, body := admin(t, http.MethodDelete, unblockPath(t, "e2e-admin", "2001:db8::/64")); status != http.StatusOK {
			t.Fatalf("DELETE of an IPv6 prefix: %d %s", status, body)
		}
		resp, _ = s.get("/", "X-Forwarded-For", "2001:db8::99")
		wantStatus(t, resp, http.StatusOK)

		var got keyList
		adminJSON(t, "/rate_limit/e2e-admin?q=203.0.113.1&limit=1000", &got)
		if got.keys() != "203.0.113.10 203.0.113.1" || got.Keys[1].Count != 1 || got.Keys[1].Refused != 0 {
			t.Errorf("after DELETE: %+v, want 203.0.113.10 then 203.0.113.1 with a fresh window", got)
		}
	})
}
