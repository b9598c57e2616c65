package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// overrideInfo is one override as the admin API lists it.
type overrideInfo struct {
	Key     string         `json:"key"`
	KeyHash string         `json:"key_hash"`
	Plan    string         `json:"plan"`
	Max     int            `json:"max"`
	Limits  map[string]any `json:"limits"`
	Expires int64          `json:"expires"`
}

// overridesOf returns the overrides the admin API lists for zone, as
// "key plan max expires" lines.
func overridesOf(t *testing.T, zone string) []string {
	t.Helper()
	var list struct {
		Zone      string         `json:"zone"`
		Overrides []overrideInfo `json:"overrides"`
		Max       int            `json:"max"`
	}
	adminJSON(t, "/rate_limit/"+zone+"/overrides", &list)
	if list.Zone != zone || list.Max != 10000 {
		t.Fatalf("overrides of %s: zone %q, max %d; want the zone and its bound of 10000", zone, list.Zone, list.Max)
	}
	lines := []string{}
	for _, o := range list.Overrides {
		lines = append(lines, fmt.Sprintf("%s %s %d %d", o.Key+o.KeyHash, o.Plan, o.Max, o.Expires))
	}
	return lines
}

// setOverride puts body as an override of zone and returns the status and
// reply.
func setOverride(t *testing.T, zone, body string) (int, string) {
	t.Helper()
	status, _, reply := adminSend(t, http.MethodPut, "/rate_limit/"+zone+"/overrides", body)
	return status, reply
}

// An override moves a key to a bigger plan mid-window: it is admitted up
// to the new max at once, against what it spent; one with values of its
// own gives them; the listing shows both; a reload keeps them; an expired
// one falls back to the key's plan, a removed one too.
func TestOverridesEndToEnd(t *testing.T) {
	zone := fresh("e2e-overrides")
	clk := fakeClock(t, zone)
	mapping := `		k-solo   free    solo
		k-big    free    big`
	s := startCaddy(t, "", plansSite(zone, mapping))
	send := func(key string, n int) ([]int, string, string) { return sendKeyed(s, key, n) }
	if st, _, _ := send("k-solo", 2); fmt.Sprint(st) != "[200 200]" {
		t.Fatalf("k-solo on the default plan: %v, want its 2", st)
	}
	if status, reply := setOverride(t, zone, `{"key": "key:k-solo", "plan": "pro", "ttl": "30s"}`); status != http.StatusOK {
		t.Fatalf("setting k-solo's override: %d %s", status, reply)
	}
	// pro gives 4 a minute, of which k-solo spent 2.
	if st, body, limit := send("k-solo", 3); fmt.Sprint(st) != "[200 200 429]" || body != "pro 4" || limit != "4" {
		t.Errorf("k-solo on pro by override: %v, %q, X-RateLimit-Limit %q; want the 2 left of pro's 4", st, body, limit)
	}
	// Values of its own, for the first limit and the tenant guard; the
	// hourly limit keeps the handler's 5.
	if status, reply := setOverride(t, zone, `{"key": "key:k-big", "max": 6, "limits": {"tenant": {"max": 50}}}`); status != http.StatusOK {
		t.Fatalf("setting k-big's override: %d %s", status, reply)
	}
	if st, body, limit := send("k-big", 6); fmt.Sprint(st) != "[200 200 200 200 200 429]" || body != "override 5" || limit != "5" {
		t.Errorf("k-big with max 6 by override: %v, %q, X-RateLimit-Limit %q; want 5 (the hourly limit binds)", st, body, limit)
	}
	expires := clk.Now().Add(30*time.Second + time.Second - 1).Unix() // rounded up to a whole second
	want := fmt.Sprintf("[key:k-big  6 0 key:k-solo pro 0 %d]", expires)
	if got := overridesOf(t, zone); fmt.Sprint(got) != want {
		t.Errorf("overrides = %v, want %s", got, want)
	}
	s.reload("", plansSite(zone, mapping))
	if got := overridesOf(t, zone); fmt.Sprint(got) != want {
		t.Errorf("overrides after a reload = %v, want %s", got, want)
	}
	// The override lapses: k-solo is back on the default plan's 2, and
	// has spent 4 of it.
	clk.Advance(31 * time.Second)
	if st, _, limit := send("k-solo", 1); fmt.Sprint(st) != "[429]" || limit != "2" {
		t.Errorf("k-solo after its override lapsed: %v, X-RateLimit-Limit %q; want 429 on the default plan's 2", st, limit)
	}
	if got := overridesOf(t, zone); fmt.Sprint(got) != "[key:k-big  6 0]" {
		t.Errorf("overrides after k-solo's lapsed = %v, want k-big's alone", got)
	}
	status, _, reply := adminSend(t, http.MethodDelete, "/rate_limit/"+zone+"/overrides?key="+url.QueryEscape("key:k-big"), "")
	if status != http.StatusOK || !strings.Contains(reply, `"removed":true`) {
		t.Errorf("removing k-big's override: %d %s", status, reply)
	}
	if status, _, _ := adminSend(t, http.MethodDelete, "/rate_limit/"+zone+"/overrides?key="+url.QueryEscape("key:k-big"), ""); status != http.StatusNotFound {
		t.Errorf("removing it again: %d, want 404", status)
	}
	clk.Advance(time.Minute) // a new window of the first limit and the tenant guard
	if st, body, _ := send("k-big", 1); fmt.Sprint(st) != "[429]" {
		t.Errorf("k-big without its override: %v %q, want 429: its hourly 5 are spent", st, body)
	}
}

// What the override API refuses: keys no request is counted under, a
// plan the zone lacks, a plan and values at once, bad values, unknown
// fields, a body too big, a path with more in it. Nothing is stored for
// any of them, and the site still serves.
func TestOverridesHostile(t *testing.T) {
	zone := fresh("e2e-overrides-hostile")
	s := startCaddy(t, "", plansSite(zone, "		k-1 free one"))
	for _, body := range []string{
		`{"key": "` + hostileKey + `", "plan": "pro"}`,
		`{"key": "key:a\nb", "plan": "pro"}`,
		`{"key": "key:` + strings.Repeat("x", 129) + `", "plan": "pro"}`,
		`{"key": "key:sha256:zz", "plan": "pro"}`,
		`{"key": "key:", "plan": "pro"}`,
		`{"key": "::ffff:192.0.2.1", "plan": "pro"}`,
		`{"key": "2001:db8::1/64", "plan": "pro"}`,
		`{"key": "key:k-1", "plan": "gold"}`,
		`{"key": "key:k-1", "plan": "pro", "max": 3}`,
		`{"key": "key:k-1"}`,
		`{"key": "key:k-1", "max": -1}`,
		`{"key": "key:k-1", "max": 3, "limits": {"nope": {"max": 1}}}`,
		`{"key": "key:k-1", "plan": "pro", "ttl": "1ms"}`,
		`{"key": "key:k-1", "plan": "pro", "expires": 1}`,
		`{"key": "key:k-1", "plan": "pro", "admin": true}`,
		`{"key": "key:k-1", "plan": "pro"} {"key": "key:k-2", "plan": "pro"}`,
		`{"key": "key:k-1", "plan": "` + strings.Repeat("p", 70000) + `"}`,
		`not json`,
	} {
		status, reply := setOverride(t, zone, body)
		if status != http.StatusBadRequest || !strings.Contains(reply, `"error"`) {
			t.Errorf("PUT %.80q: %d %s, want 400 with an error", body, status, reply)
		}
	}
	for _, path := range []string{
		"/rate_limit/" + zone + "/overrides/key:k-1",
		"/rate_limit/" + zone + "/x/overrides",
		"/rate_limit/" + zone + "/overrides?key=key:k-1&key=key:k-2",
	} {
		if status, _, reply := adminSend(t, http.MethodPut, path, `{"key": "key:k-1", "plan": "pro"}`); status != http.StatusBadRequest {
			t.Errorf("PUT %s: %d %s, want 400", path, status, reply)
		}
	}
	if status, _, _ := adminSend(t, http.MethodPut, "/rate_limit/no-such-zone/overrides", `{"key": "key:k-1", "plan": "pro"}`); status != http.StatusNotFound {
		t.Errorf("PUT to an unknown zone: %d, want 404", status)
	}
	if got := overridesOf(t, zone); len(got) != 0 {
		t.Errorf("overrides = %v, want none stored", got)
	}
	// A key a client chose, hostile as it may be, is a key like any
	// other once it is in the form the listing shows.
	if status, reply := setOverride(t, zone, `{"key": "key:`+hostileKey+`", "plan": "pro"}`); status != http.StatusOK {
		t.Fatalf("override of the hostile key: %d %s", status, reply)
	}
	var list struct {
		Overrides []overrideInfo `json:"overrides"`
	}
	adminJSON(t, "/rate_limit/"+zone+"/overrides", &list)
	if len(list.Overrides) != 1 || list.Overrides[0].Key != "key:"+hostileKey {
		raw, _ := json.Marshal(list)
		t.Errorf("overrides = %s, want the hostile key's alone", raw)
	}
	for range 4 {
		if resp, body := s.get("/", "X-API-Key", hostileKey); resp.StatusCode != http.StatusOK || body != "pro 4" {
			t.Fatalf("the hostile key on pro: %d %q", resp.StatusCode, body)
		}
	}
}

// plansRedisSite is plansSite on Redis at addr, with more of the store's
// options (a line, or "").
func plansRedisSite(zone, mapping, addr, more string) string {
	store := fmt.Sprintf("store redis {\n\t\t\taddress %s\n\t\t\ttimeout 1s\n\t\t\t%s\n", addr, more)
	return strings.Replace(plansSite(zone, mapping), "plan_by {plan}", store+"\t\t}\n\t\tplan_by {plan}", 1)
}

// Two instances on one Redis, in exact and in sync mode, and with hashed
// keys: an override set through one instance's admin API applies on the
// other within a second, though the other's subscription was cut when it
// was set (it reads the overrides again when it subscribes anew); removing
// it applies there too. With hashed keys Redis holds no client key.
func TestFleetOverrides(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { rdb.Close() })
	for _, mode := range []struct{ name, store string }{{"exact", ""}, {"sync", "sync 100ms"}, {"hashed", "hash_keys s3cret"}} {
		t.Run(mode.name, func(t *testing.T) {
			zone := fresh("e2e-fleet-overrides-" + mode.name)
			// An hour's window, which the few seconds of the test are
			// unlikely to cross: sync mode aligns it to the epoch.
			site := strings.Replace(plansRedisSite(zone, "		k-solo free solo", srv.Addr, mode.store), "window 60", "window 3600", 1)
			startCaddy(t, "", site)
			b := startCaddyProcess(t, site)
			get := func(base string) int { return statusOf(t, base, "X-API-Key", "k-solo") }
			untilWindowLeft(time.Hour, 20*time.Second) // waits only in the hour's last 20 seconds
			admitted := 0
			for range 3 {
				if get(b) == http.StatusOK {
					admitted++
				}
			}
			if admitted != 2 {
				t.Fatalf("the other instance admitted %d of 3 on the default plan, want 2", admitted)
			}
			if err := rdb.Do(context.Background(), "CLIENT", "KILL", "TYPE", "pubsub").Err(); err != nil {
				t.Fatal(err)
			}
			if status, reply := setOverride(t, zone, `{"key": "key:k-solo", "plan": "partner"}`); status != http.StatusOK {
				t.Fatalf("setting the override: %d %s", status, reply)
			}
			took := within(t, time.Second, "the other instance applies the override", func() bool { return get(b) == http.StatusOK })
			t.Logf("the other instance applied the override %s after it was set", took.Round(time.Millisecond))
			want, remove := "[key:k-solo partner 0 0]", "key=key:k-solo"
			if mode.name == "hashed" {
				stored, err := rdb.HGetAll(context.Background(), "caddy_rate_limit:"+zone+":overrides").Result()
				raw := fmt.Sprint(stored)
				if err != nil || len(stored) != 1 || strings.Contains(raw, "k-solo") {
					t.Errorf("Redis holds %s (%v), want one override without its key", raw, err)
				}
				for tag := range stored {
					// The listing has the hash alone, which removes it.
					want, remove = fmt.Sprintf("[%s partner 0 0]", tag), "key_hash="+tag
				}
			}
			if got := overridesOf(t, zone); fmt.Sprint(got) != want {
				t.Errorf("overrides = %v, want %s", got, want)
			}
			if status, _, reply := adminSend(t, http.MethodDelete, "/rate_limit/"+zone+"/overrides?"+remove, ""); status != http.StatusOK {
				t.Fatalf("removing the override: %d %s", status, reply)
			}
			within(t, time.Second, "the other instance drops the removed override", func() bool { return get(b) == http.StatusTooManyRequests })
		})
	}
}
