package tests

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// spoofableKeyMsg opens the warning Caddy logs once per server when clients
// behind a trusted proxy choose their own key.
const spoofableKeyMsg = "clients behind a trusted proxy choose their own rate limit key"

// proxiedSite limits the zone it is formatted with to 5 requests a minute
// per client IP and answers with the client IP Caddy resolved.
const proxiedSite = `
:$PORT {
	rate_limit {
		zone %s
		max 5
	}
	respond "{client_ip}"
}`

// behindProxy is the global options of a server behind a proxy at
// 127.0.0.1, the address the test client dials from, with Caddy's log
// going to logFile as JSON; strict adds trusted_proxies_strict.
func behindProxy(logFile string, strict bool) string {
	opts := fmt.Sprintf("log {\n\t\toutput file %s\n\t\tformat json\n\t}\n\tservers {\n\t\ttrusted_proxies static 127.0.0.1/32\n", logFile)
	if strict {
		opts += "\t\ttrusted_proxies_strict\n"
	}
	return opts + "\t}"
}

// spoofableKeyWarnings returns the spoofable key warnings in the JSON log
// at path.
func spoofableKeyWarnings(t *testing.T, path string) []map[string]any {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var found []map[string]any
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var entry map[string]any
		if err := json.Unmarshal(sc.Bytes(), &entry); err != nil {
			t.Fatalf("log line %q: %v", sc.Text(), err)
		}
		if msg, _ := entry["msg"].(string); strings.HasPrefix(msg, spoofableKeyMsg) {
			found = append(found, entry)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return found
}

// zoneInfo is the part of a zone in GET /rate_limit/ this test reads.
type zoneInfo struct {
	Name         string `json:"name"`
	TrackedKeys  int    `json:"tracked_keys"`
	SpoofableKey bool   `json:"spoofable_key"`
}

// zoneNamed returns the zone called name in the zone list.
func zoneNamed(t *testing.T, name string) zoneInfo {
	t.Helper()
	var zones []zoneInfo
	adminJSON(t, "/rate_limit/", &zones)
	for _, z := range zones {
		if z.Name == name {
			return z
		}
	}
	t.Fatalf("zone %s not in the zone list %+v", name, zones)
	return zoneInfo{}
}

// A client behind a proxy that appends to X-Forwarded-For (nginx's
// $proxy_add_x_forwarded_for, played by the test client at the trusted
// 127.0.0.1) writes its own leftmost entry, a new one each time. Without
// trusted_proxies_strict it chooses its key: all ten requests pass max 5,
// the zone lists the ten addresses it made up, and Caddy says so: one
// warning with the fix over all the requests, the zone flagged in the
// listing and by `caddy rate-limit zones`. Reloaded with strict, the same
// client is keyed by the address the proxy saw and refused after 5, with no
// warning, and the flag is gone.
func TestSpoofedForwardedFor(t *testing.T) {
	const zone = "e2e-proxy-spoof"
	const real = "203.0.113.70" // the address the proxy saw
	forwarded := func(i int) (string, string) {
		spoofed := fmt.Sprintf("198.51.100.%d", i)
		return spoofed, spoofed + ", " + real
	}
	laxLog := filepath.Join(t.TempDir(), "lax.log")
	s := startCaddy(t, behindProxy(laxLog, false), fmt.Sprintf(proxiedSite, zone))
	var spoofed []string
	for i := range 10 {
		ip, header := forwarded(i)
		spoofed = append(spoofed, ip)
		resp, body := s.get("/", "X-Forwarded-For", header)
		if resp.StatusCode != http.StatusOK || body != ip {
			t.Fatalf("without strict, request %d: %d, client_ip %q; want 200 keyed by the client's own %s", i+1, resp.StatusCode, body, ip)
		}
	}

	warnings := spoofableKeyWarnings(t, laxLog)
	if len(warnings) != 1 {
		t.Fatalf("%d spoofable key warnings over 10 requests, want 1: %v", len(warnings), warnings)
	}
	w := warnings[0]
	if w["level"] != "warn" || w["zone"] != zone || w["server"] != "srv0" ||
		!strings.Contains(fmt.Sprint(w["fix"]), "trusted_proxies_strict") || !strings.Contains(fmt.Sprint(w["fix"]), "every proxy in front of Caddy") {
		t.Errorf("warning = %v, want a warn naming the zone, the server and the fix", w)
	}
	if z := zoneNamed(t, zone); !z.SpoofableKey || z.TrackedKeys != 10 {
		t.Errorf("zone listed as %+v, want spoofable_key and the 10 made-up keys", z)
	}
	var list keyList
	adminJSON(t, "/rate_limit/"+zone, &list)
	var keys []string
	for _, k := range list.Keys {
		keys = append(keys, k.Key)
	}
	slices.Sort(keys)
	slices.Sort(spoofed)
	if !slices.Equal(keys, spoofed) {
		t.Errorf("keys listed %v, want the client's made-up %v", keys, spoofed)
	}
	_, body := admin(t, http.MethodGet, "/rate_limit/"+zone)
	if !strings.Contains(body, `"spoofable_key":true`) {
		t.Errorf("key listing %s lacks spoofable_key", body)
	}
	out, err := rateLimitCmd(t, "zones")
	if err != nil || !strings.Contains(out, "warning: zone "+zone+": clients behind a trusted proxy choose their own key") ||
		!strings.Contains(out, "set trusted_proxies_strict") {
		t.Errorf("caddy rate-limit zones: %v, want the zone's warning:\n%s", err, out)
	}

	strictLog := filepath.Join(t.TempDir(), "strict.log")
	s.reload(behindProxy(strictLog, true), fmt.Sprintf(proxiedSite, zone))
	for i := range 10 {
		_, header := forwarded(10 + i)
		resp, body := s.get("/", "X-Forwarded-For", header)
		want := http.StatusOK
		if i >= 5 {
			want = http.StatusTooManyRequests
		}
		if resp.StatusCode != want || (want == http.StatusOK && body != real) {
			t.Fatalf("with strict, request %d: %d, client_ip %q; want %d keyed by %s", i+1, resp.StatusCode, body, want, real)
		}
	}
	if warnings := spoofableKeyWarnings(t, strictLog); len(warnings) != 0 {
		t.Errorf("with strict, %d spoofable key warnings, want none: %v", len(warnings), warnings)
	}
	if z := zoneNamed(t, zone); z.SpoofableKey {
		t.Errorf("with strict, zone listed as %+v, want no spoofable_key", z)
	}
	out, err = rateLimitCmd(t, "zones")
	if err != nil || strings.Contains(out, "warning:") {
		t.Errorf("caddy rate-limit zones with strict: %v, want no warning:\n%s", err, out)
	}
}
