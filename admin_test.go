package ratelimit

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"reflect"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// adminDo sends one request to the admin API's handler and returns the
// recorded response and the handler's error.
func adminDo(t testing.TB, method, target string) (*httptest.ResponseRecorder, error) {
	t.Helper()
	routes := AdminAPI{}.Routes()
	if len(routes) != 2 || routes[0].Pattern != "/rate_limit/" || routes[1].Pattern != "/rate_limit" {
		t.Fatalf("routes = %+v, want /rate_limit/ and /rate_limit", routes)
	}
	w := httptest.NewRecorder()
	err := routes[0].Handler.ServeHTTP(w, httptest.NewRequest(method, target, nil))
	return w, err
}

// adminGet sends a GET that must succeed and decodes its JSON body into v.
func adminGet(t testing.TB, target string, v any) {
	t.Helper()
	w, err := adminDo(t, http.MethodGet, target)
	if err != nil {
		t.Fatalf("GET %s: %v", target, err)
	}
	if w.Code != http.StatusOK {
		t.Fatalf("GET %s: status %d", target, w.Code)
	}
	if ct := w.Header().Get("Content-Type"); ct != "application/json" {
		t.Errorf("GET %s: Content-Type = %q", target, ct)
	}
	if err := json.Unmarshal(w.Body.Bytes(), v); err != nil {
		t.Fatalf("GET %s: decoding %q: %v", target, w.Body.String(), err)
	}
}

// wantAPIError fails the test unless err is a caddy.APIError with status and
// a message containing text.
func wantAPIError(t *testing.T, err error, status int, text string) {
	t.Helper()
	var aerr caddy.APIError
	if !errors.As(err, &aerr) {
		t.Fatalf("error = %v, want a caddy.APIError", err)
	}
	if aerr.HTTPStatus != status {
		t.Errorf("status = %d, want %d (%v)", aerr.HTTPStatus, status, aerr.Err)
	}
	if !strings.Contains(aerr.Err.Error(), text) {
		t.Errorf("error %q does not mention %q", aerr.Err, text)
	}
}

func TestAdminListZones(t *testing.T) {
	t.Parallel()
	on, _ := provisionHandler(t, "admin-zones-on", 2, true)
	provisionHandler(t, "admin-zones-off", 7, false)
	for range 3 {
		serve(t, on, "192.0.2.1")
	}
	serve(t, on, "192.0.2.2")

	var got []ZoneInfo
	adminGet(t, "/rate_limit/", &got)
	byName := map[string]ZoneInfo{}
	for _, z := range got {
		byName[z.Name] = z
	}
	want := map[string]ZoneInfo{
		"admin-zones-on": {Name: "admin-zones-on", Status: "active", Enabled: true, Store: "memory", Algorithm: "fixed",
			WindowSeconds: 60, Max: 2, TrackedKeys: 2, RejectedTotal: 1, Policies: []PolicyInfo{{Name: "admin-zones-on", Max: 2, WindowSeconds: 60}}},
		"admin-zones-off": {Name: "admin-zones-off", Status: "disabled", Enabled: false, Store: "memory", Algorithm: "fixed",
			WindowSeconds: 60, Max: 7, Policies: []PolicyInfo{{Name: "admin-zones-off", Max: 7, WindowSeconds: 60}}},
	}
	for name, w := range want {
		if g, ok := byName[name]; !ok {
			t.Errorf("zone %q not listed in %+v", name, got)
		} else if !reflect.DeepEqual(g, w) {
			t.Errorf("zone %q = %+v, want %+v", name, g, w)
		}
	}
}

// seedKeys fills a zone (max 5) with keys whose totals make the order
// predictable: c 9 (5 admitted, 4 refused), a and b 3 each, d 1, and one
// key in another network.
func seedKeys(t *testing.T, zoneName string) *RateLimit {
	rl, _ := provisionHandler(t, zoneName, 5, true)
	hitN(t, rl, "203.0.113.10", 3) // a
	hitN(t, rl, "203.0.113.9", 3)  // b: ties with a, sorts after it by key
	hitN(t, rl, "203.0.113.200", 9)
	hitN(t, rl, "203.0.113.7", 1)
	hitN(t, rl, "198.51.100.1", 2)
	return rl
}

func TestAdminListKeys(t *testing.T) {
	t.Parallel()
	seedKeys(t, "admin-keys")
	tests := []struct {
		query     string
		wantTotal int
		wantKeys  []string
	}{
		{"", 5, []string{"203.0.113.200", "203.0.113.10", "203.0.113.9", "198.51.100.1", "203.0.113.7"}},
		{"?limited=true", 1, []string{"203.0.113.200"}},
		{"?limited=false", 5, []string{"203.0.113.200", "203.0.113.10", "203.0.113.9", "198.51.100.1", "203.0.113.7"}},
		{"?q=203.0.113.", 4, []string{"203.0.113.200", "203.0.113.10", "203.0.113.9", "203.0.113.7"}},
		{"?q=198.", 1, []string{"198.51.100.1"}},
		{"?q=10.", 0, []string{}},
		{"?limit=2", 5, []string{"203.0.113.200", "203.0.113.10"}},
		{"?offset=2&limit=2", 5, []string{"203.0.113.9", "198.51.100.1"}},
		{"?offset=4&limit=2", 5, []string{"203.0.113.7"}},
		{"?offset=99", 5, []string{}},
		{"?offset=9000&limit=1000", 5, []string{}}, // the deepest page
		{"?q=203.0.113.&offset=1&limit=1", 4, []string{"203.0.113.10"}},
	}
	for _, tt := range tests {
		t.Run(tt.query, func(t *testing.T) {
			var got KeyList
			adminGet(t, "/rate_limit/admin-keys"+tt.query, &got)
			if got.Zone != "admin-keys" || got.Total != tt.wantTotal {
				t.Errorf("zone %q total %d, want admin-keys %d", got.Zone, got.Total, tt.wantTotal)
			}
			keys := []string{}
			for _, k := range got.Keys {
				keys = append(keys, k.Key)
			}
			if fmt.Sprint(keys) != fmt.Sprint(tt.wantKeys) {
				t.Errorf("keys = %v, want %v", keys, tt.wantKeys)
			}
		})
	}
}

func TestAdminKeyFields(t *testing.T) {
	t.Parallel()
	seedKeys(t, "admin-fields")
	var got KeyList
	adminGet(t, "/rate_limit/admin-fields?limit=2", &got)
	if got.Offset != 0 || got.Limit != 2 || len(got.Keys) != 2 {
		t.Fatalf("page = %+v, want offset 0, limit 2, two keys", got)
	}
	top, second := got.Keys[0], got.Keys[1]
	if top.Key != "203.0.113.200" || top.Count != 5 || top.Refused != 4 || top.Remaining != 0 || !top.Limited {
		t.Errorf("top = %+v, want 203.0.113.200 count 5 refused 4 remaining 0 limited", top)
	}
	if second.Count != 3 || second.Refused != 0 || second.Remaining != 2 || second.Limited {
		t.Errorf("second = %+v, want count 3 refused 0 remaining 2 not limited", second)
	}
	if top.Reset < 1e9 {
		t.Errorf("reset = %d, want Unix seconds", top.Reset)
	}
}

func TestAdminEmptyListsAreArrays(t *testing.T) {
	t.Parallel()
	provisionHandler(t, "admin-empty", 5, true)
	w, err := adminDo(t, http.MethodGet, "/rate_limit/admin-empty")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(w.Body.String(), `"keys":[]`) || !strings.Contains(w.Body.String(), `"total":0`) {
		t.Errorf("body = %s, want total 0 and keys []", w.Body)
	}
}

func TestAdminForget(t *testing.T) {
	t.Parallel()
	rl, _ := provisionHandler(t, "admin-forget", 1, true)
	serve(t, rl, "192.0.2.50")
	if got := serve(t, rl, "192.0.2.50"); got != http.StatusTooManyRequests {
		t.Fatalf("second request: status %d, want 429", got)
	}
	// IPv6 keys hold a slash; the listing's unblock path escapes it.
	serve(t, rl, "2001:db8::1")

	var list KeyList
	adminGet(t, "/rate_limit/admin-forget", &list)
	unblock := map[string]string{}
	for _, k := range list.Keys {
		unblock[k.Key] = k.Unblock
	}
	want := map[string]string{
		"192.0.2.50":    "/rate_limit/admin-forget?key=192.0.2.50",
		"2001:db8::/64": "/rate_limit/admin-forget?key=2001%3Adb8%3A%3A%2F64",
	}
	if !maps.Equal(unblock, want) {
		t.Fatalf("unblock paths = %v, want %v", unblock, want)
	}
	for key, path := range want {
		w, err := adminDo(t, http.MethodDelete, path)
		if err != nil || w.Code != http.StatusOK {
			t.Fatalf("DELETE %s: status %d, error %v", path, w.Code, err)
		}
		if body := w.Body.String(); !strings.Contains(body, `"forgotten":true`) || !strings.Contains(body, fmt.Sprintf("%q", key)) {
			t.Errorf("DELETE %s: body %s", path, body)
		}
		_, err = adminDo(t, http.MethodDelete, path)
		wantAPIError(t, err, http.StatusNotFound, "not tracked")
	}
	if got := serve(t, rl, "192.0.2.50"); got != http.StatusOK {
		t.Errorf("after DELETE: status %d, want 200", got)
	}
	_, err := adminDo(t, http.MethodDelete, "/rate_limit/no-such-zone?key=192.0.2.50")
	wantAPIError(t, err, http.StatusNotFound, `unknown rate limit zone "no-such-zone"`)
}

func TestAdminErrors(t *testing.T) {
	t.Parallel()
	provisionHandler(t, "admin-errors", 5, true)
	tests := []struct {
		method, target string
		status         int
		text           string
	}{
		{http.MethodGet, "/rate_limit/no-such-zone", http.StatusNotFound, `unknown rate limit zone "no-such-zone"`},
		{http.MethodPost, "/rate_limit/", http.StatusMethodNotAllowed, "method POST not allowed"},
		{http.MethodPost, "/rate_limit/admin-errors", http.StatusMethodNotAllowed, "method POST not allowed: use GET or DELETE"},
		{http.MethodGet, "/rate_limit/?q=x", http.StatusBadRequest, `unknown query parameter "q": this endpoint takes none`},
		// A key never travels in the path, whatever the method.
		{http.MethodDelete, "/rate_limit/admin-errors/192.0.2.1", http.StatusBadRequest, "a key goes in the query"},
		{http.MethodGet, "/rate_limit/admin-errors/192.0.2.1", http.StatusBadRequest, "a key goes in the query"},
		{http.MethodDelete, "/rate_limit/admin-errors/", http.StatusBadRequest, "a key goes in the query"},
		{http.MethodDelete, "/rate_limit/admin-errors/key:%2F%2E%2E%2F%2E%2E%2Fconfig%2F", http.StatusBadRequest, "a key goes in the query"},
		{http.MethodDelete, "/rate_limit/%2E%2E", http.StatusBadRequest, "invalid path"},
		{http.MethodDelete, "/rate_limit/a%2Fb", http.StatusBadRequest, "invalid path"},
		{http.MethodDelete, "/rate_limit/admin-errors", http.StatusBadRequest, "missing query parameter key"},
		{http.MethodDelete, "/rate_limit/admin-errors?key=", http.StatusBadRequest, "missing query parameter key"},
		{http.MethodDelete, "/rate_limit/admin-errors?key=a&key=b", http.StatusBadRequest, `query parameter "key" given more than once`},
		{http.MethodDelete, "/rate_limit/admin-errors?key=a&q=b", http.StatusBadRequest, `unknown query parameter "q": want key`},
		{http.MethodDelete, "/rate_limit/admin-errors?key=%zz", http.StatusBadRequest, `malformed query parameter "key"`},
		// Strict parsing: what url.ParseQuery would drop or take silently.
		{http.MethodGet, "/rate_limit/admin-errors?q=203.0.113.%", http.StatusBadRequest, `malformed query parameter "q"`},
		{http.MethodGet, "/rate_limit/admin-errors?limited=true;", http.StatusBadRequest, `malformed query parameter "limited=true;"`},
		{http.MethodGet, "/rate_limit/admin-errors?offset=1;limit=1", http.StatusBadRequest, `malformed query parameter "offset=1;limit=1"`},
		{http.MethodGet, "/rate_limit/admin-errors?q=x&bogus=%", http.StatusBadRequest, `unknown query parameter "bogus"`},
		{http.MethodGet, "/rate_limit/admin-errors?limit=1&limit=2", http.StatusBadRequest, `query parameter "limit" given more than once`},
		{http.MethodGet, "/rate_limit/admin-errors?limited", http.StatusBadRequest, `malformed query parameter "limited"`},
		{http.MethodGet, "/rate_limit/admin-errors?q=a&&limit=1", http.StatusBadRequest, `malformed query parameter ""`},
		{http.MethodGet, "/rate_limit/admin-errors?limited=1", http.StatusBadRequest, `invalid limited "1"`},
		{http.MethodGet, "/rate_limit/admin-errors?limit=0", http.StatusBadRequest, `invalid limit "0"`},
		{http.MethodGet, "/rate_limit/admin-errors?limit=1001", http.StatusBadRequest, `invalid limit "1001"`},
		{http.MethodGet, "/rate_limit/admin-errors?limit=ten", http.StatusBadRequest, `invalid limit "ten"`},
		{http.MethodGet, "/rate_limit/admin-errors?offset=-1", http.StatusBadRequest, `invalid offset "-1"`},
		// offset+limit is capped at MaxListDepth, whatever the zone holds.
		{http.MethodGet, "/rate_limit/admin-errors?offset=9001&limit=1000", http.StatusBadRequest, "invalid offset 9001 with limit 1000: offset+limit must be at most 10000"},
		{http.MethodGet, "/rate_limit/admin-errors?offset=9901", http.StatusBadRequest, "invalid offset 9901 with limit 100: offset+limit must be at most 10000"},
		{http.MethodGet, "/rate_limit/admin-errors?offset=9223372036854775000&limit=1000", http.StatusBadRequest, "invalid offset 9223372036854775000 with limit 1000: offset+limit must be at most 10000"},
		{http.MethodGet, "/rate_limit/admin-errors?offset=9223372036854775807&limit=1", http.StatusBadRequest, "offset+limit must be at most 10000"},
		{http.MethodGet, "/rate_limit/admin-errors?offset=9223372036854775808", http.StatusBadRequest, `invalid offset "9223372036854775808"`},
		{http.MethodGet, "/rate_limit/admin-errors?limited=yes", http.StatusBadRequest, `invalid limited "yes"`},
		{http.MethodGet, "/rate_limit/admin-errors?limted=true", http.StatusBadRequest, `unknown query parameter "limted"`},
	}
	for _, tt := range tests {
		t.Run(tt.method+" "+tt.target, func(t *testing.T) {
			_, err := adminDo(t, tt.method, tt.target)
			wantAPIError(t, err, tt.status, tt.text)
		})
	}
}

// The top-k selection returns the same page as sorting every match.
func TestTopKeysMatchesFullSort(t *testing.T) {
	t.Parallel()
	rng := rand.New(rand.NewPCG(1, 2))
	for trial := range 1000 {
		n := rng.IntN(500)
		all := make([]limiter.KeyState, n)
		for i := range all {
			all[i] = limiter.KeyState{Key: fmt.Sprintf("k%d", rng.IntN(1_000_000)*1000+i), Count: rng.IntN(5), Refused: rng.IntN(3)}
		}
		offset, limit := rng.IntN(n+10), 1+rng.IntN(n+10)
		top := topKeys{k: offset + limit}
		for _, ks := range all {
			top.offer(ks)
		}
		want := slices.Clone(all)
		slices.SortFunc(want, func(a, b limiter.KeyState) int {
			if c := cmp.Compare(b.Count+b.Refused, a.Count+a.Refused); c != 0 {
				return c
			}
			return strings.Compare(a.Key, b.Key)
		})
		want = want[min(offset, n):]
		want = want[:min(limit, len(want))]
		if got := top.page(offset, limit); !slices.Equal(got, want) && len(got)+len(want) > 0 {
			t.Fatalf("trial %d (n %d, offset %d, limit %d): got %v, want %v", trial, n, offset, limit, got, want)
		}
	}
}

// BenchmarkList100k lists a zone tracking 100,000 keys: the first page of
// 1000, the deepest page MaxListDepth allows, and a filtered listing.
func BenchmarkList100k(b *testing.B) {
	rl, _ := provisionHandler(b, "admin-bench-100k", 5, true)
	for i := range 100_000 {
		hitN(b, rl, fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&255, i&255), 1+i%7)
	}
	if n := rl.zone.store.Len(); n != 100_000 {
		b.Fatalf("tracked %d keys, want 100000", n)
	}
	for _, query := range []string{"?limit=1000", "?offset=9000&limit=1000", "?limited=true&q=10.1.&limit=1000"} {
		b.Run(query, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				w, err := adminDo(b, http.MethodGet, "/rate_limit/admin-bench-100k"+query)
				if err != nil || w.Code != http.StatusOK {
					b.Fatalf("status %d, error %v", w.Code, err)
				}
			}
		})
	}
}

// A listing holds at most 2×(offset+limit) keys while it scans (at least 64
// before its first trim), and none when its page starts past every key the
// zone tracks; a filter the store cannot judge ahead holds at most its
// matches.
func TestAdminListingKeysHeld(t *testing.T) {
	t.Parallel()
	rl, _ := provisionHandler(t, "admin-held", 5, true)
	const keys = 300 // 10.0.0.0-10.0.0.255, 10.0.1.0-10.0.1.43
	for i := range keys {
		hitN(t, rl, fmt.Sprintf("10.0.%d.%d", i>>8, i&255), 1+i%3)
	}
	tests := []struct {
		query     string
		wantTotal int
		wantPage  int
		maxHeld   int
	}{
		{"", keys, 100, 200},
		{"?limit=10", keys, 10, 64},
		{"?offset=290&limit=10", keys, 10, keys},
		{"?offset=299&limit=1000", keys, 1, keys},
		{"?offset=300&limit=10", keys, 0, 0}, // at the count
		{"?offset=301", keys, 0, 0},
		{"?offset=9000&limit=1000", keys, 0, 0}, // the deepest page
		{"?q=10.0.0.&offset=250", 256, 6, 256},
		{"?q=10.0.1.&offset=100", 44, 0, 44},
	}
	for _, tt := range tests {
		t.Run(tt.query, func(t *testing.T) {
			params, err := parseQuery(strings.TrimPrefix(tt.query, "?"), "q", "offset", "limit")
			if err != nil {
				t.Fatal(err)
			}
			q, err := parseListQuery(params)
			if err != nil {
				t.Fatal(err)
			}
			best, total, err := rl.zone.matches(context.Background(), q, time.Now(), rl.zone.limits())
			if err != nil {
				t.Fatal(err)
			}
			page := best.page(q.offset, q.pageSize)
			if total != tt.wantTotal || len(page) != tt.wantPage {
				t.Errorf("total %d with a page of %d, want %d and %d", total, len(page), tt.wantTotal, tt.wantPage)
			}
			if best.peak > tt.maxHeld {
				t.Errorf("held %d keys at once, want at most %d", best.peak, tt.maxHeld)
			}
			// What the endpoint answers agrees.
			var got KeyList
			adminGet(t, "/rate_limit/admin-held"+tt.query, &got)
			if got.Total != tt.wantTotal || len(got.Keys) != tt.wantPage {
				t.Errorf("GET: total %d with %d keys, want %d and %d", got.Total, len(got.Keys), tt.wantTotal, tt.wantPage)
			}
		})
	}
}

// slowScan delays every SCAN the client sends, as a Redis holding hundreds
// of thousands of keys would make a count slow.
type slowScan struct{ delay time.Duration }

func (slowScan) DialHook(next redis.DialHook) redis.DialHook { return next }

func (slowScan) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (h slowScan) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "scan" {
			time.Sleep(h.delay)
		}
		return next(ctx, cmd)
	}
}

// A Redis zone's tracked keys in the zone list: while the count of its keys
// in Redis has not finished, the JSON says the number is partial rather than
// showing a bare 0; once it has, the number is the count, with no age while
// it is fresh.
func TestAdminRedisTrackedKeys(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	const zone = "admin-redis-tracked"
	rl, _ := provisionHandler(t, zone, 5, true, func(rl *RateLimit) {
		rl.Store = &StoreConfig{Type: StoreRedis, Addresses: []string{srv.Addr}}
	})
	for i := range 30 {
		serve(t, rl, fmt.Sprintf("192.0.2.%d", i))
	}
	client, _ := loadRedisClient(rl.Store) // the zone's own: this test's server
	t.Cleanup(func() { releaseRedisClient(rl.Store.connKey) })
	client.AddHook(slowScan{200 * time.Millisecond})

	// zoneJSON returns the zone's entry in the zone list's JSON, as a
	// reader that waits at most wait sees it.
	zoneJSON := func(wait time.Duration) map[string]any {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		defer cancel()
		body, err := json.Marshal(listZones(ctx))
		if err != nil {
			t.Fatal(err)
		}
		var zones []map[string]any
		if err := json.Unmarshal(body, &zones); err != nil {
			t.Fatal(err)
		}
		for _, z := range zones {
			if z["name"] == zone {
				return z
			}
		}
		t.Fatalf("zone %s not in %s", zone, body)
		return nil
	}
	if z := zoneJSON(20 * time.Millisecond); z["tracked_keys_partial"] != true {
		t.Errorf("zone list while the count runs: %v, want tracked_keys_partial true", z)
	}
	z := zoneJSON(5 * time.Second)
	_, partial := z["tracked_keys_partial"]
	_, aged := z["tracked_keys_age_seconds"]
	if z["tracked_keys"] != 30.0 || partial || aged || z["health"] != limiter.HealthHealthy {
		t.Errorf("zone list once counted: %v, want tracked_keys 30, HEALTHY, no partial flag and no age", z)
	}
}

// A key banned past its window, whose window the sweep has purged, is still
// listed from the first page: the listing's "past every key" shortcut
// counts bans as well as windows.
func TestAdminListsBanPastItsWindow(t *testing.T) {
	t.Parallel()
	rl, _ := provisionHandler(t, "admin-ban-swept", 5, true)
	ban := limiter.Check{Key: "203.0.113.66", Limit: limiter.Limit{Window: time.Second, Max: 1, Ban: time.Hour}}
	start := time.Now()
	out := make([]limiter.Verdict, 1)
	for range 2 {
		if err := rl.zone.store.Decide(context.Background(), []limiter.Check{ban}, start, out); err != nil {
			t.Fatal(err)
		}
	}
	later := start.Add(2 * time.Second)
	if n := rl.zone.store.(*limiter.MemoryStore).Sweep(later); n != 1 || rl.zone.store.Len() != 0 {
		t.Fatalf("sweep purged %d windows and left %d, want 1 and 0", n, rl.zone.store.Len())
	}
	got, err := rl.zone.list(context.Background(), listQuery{pageSize: DefaultPageSize}, later)
	if err != nil {
		t.Fatal(err)
	}
	if got.Total != 1 || len(got.Keys) != 1 || got.Keys[0].Key != ban.Key || got.Keys[0].BannedUntil == 0 {
		t.Errorf("listing = %+v, want %s, banned", got, ban.Key)
	}
}

// While a listing holds its page, the heap holds that page and not the text
// of the zone's keys: the memory store cuts a shard's keys from one buffer,
// and a kept key must not keep its shard's buffer whole. (Not parallel: it
// reads the heap's size.)
func TestAdminListingLetsGoOfZoneKeys(t *testing.T) {
	rl, _ := provisionHandler(t, "admin-unpinned", 5, true)
	const keys = 40_000 // 15 bytes of text each when pinned: 600 KB
	for i := range keys {
		hitN(t, rl, fmt.Sprintf("10.%d.%d.%d", i>>16, (i>>8)&255, i&255), 1+i%7)
	}
	var before, during runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	best, total, err := rl.zone.matches(context.Background(), listQuery{pageSize: DefaultPageSize}, time.Now(), rl.zone.limits())
	if err != nil || total != keys {
		t.Fatalf("matches: %d, %v; want %d", total, err, keys)
	}
	runtime.GC()
	runtime.ReadMemStats(&during)
	grew := int64(during.HeapAlloc) - int64(before.HeapAlloc)
	if grew > 128<<10 {
		t.Errorf("the heap grew by %d KB while a page of %d keys (%d held) was held, want at most 128 KB", grew>>10, DefaultPageSize, len(best.items))
	}
	runtime.KeepAlive(best)
}
