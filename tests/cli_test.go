package tests

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// rateLimitCmd runs the built binary's "caddy rate-limit" with args against
// the in-process Caddy's admin endpoint and returns its output and exit
// error.
func rateLimitCmd(t *testing.T, args ...string) (string, error) {
	t.Helper()
	bin, err := caddyBinary()
	if err != nil {
		t.Fatal(err)
	}
	args = append([]string{"rate-limit"}, args...)
	args = append(args, "--address", fmt.Sprintf("localhost:%d", adminPort))
	out, err := exec.Command(bin, args...).CombinedOutput()
	return string(out), err
}

// The rate-limit command against a real Caddy: zones and top print aligned
// tables (or the API's JSON), top filters and pages, unblock forgets a key,
// even a hostile one, and errors exit non-zero with the API's message.
func TestCommandLine(t *testing.T) {
	s := startCaddy(t, trustLoopbackStrict, `
:$PORT {
	rate_limit /keyed {
		zone e2e-cli-keys
		key {http.request.header.X-Key}
		max 1
	}
	@rest not path /keyed
	rate_limit @rest {
		zone e2e-cli
		window 60
		max 3
	}
	respond "ok"
}`)
	sendTraffic(t, s, map[string]int{"203.0.113.1": 5, "203.0.113.2": 4, "198.51.100.9": 1})
	s.get("/keyed", "X-Key", hostileKey)
	if resp, _ := s.get("/keyed", "X-Key", hostileKey); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("hostile key's second request: %d, want 429", resp.StatusCode)
	}

	out, err := rateLimitCmd(t, "zones")
	if err != nil {
		t.Fatalf("zones: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	header := regexp.MustCompile(`^ZONE +STATUS +STORE +HEALTH +WINDOW +MAX +KEYS +REFUSED +WEBSOCKETS$`)
	row := regexp.MustCompile(`(?m)^e2e-cli +active +memory +- +1m +3 +3 +3 +0$`)
	if len(lines) < 3 || !header.MatchString(lines[0]) || !row.MatchString(out) {
		t.Errorf("zones printed:\n%s", out)
	}
	// Columns line up: every row's second column starts where STATUS does.
	col := strings.Index(lines[0], "STATUS")
	for _, l := range lines[1:] {
		if len(l) <= col || l[col-1] != ' ' || l[col] == ' ' {
			t.Errorf("row %q is not aligned under STATUS at %d", l, col)
		}
	}

	// By default, the keys refused in the last five minutes, most refused
	// first; the key never refused is not among them.
	out, err = rateLimitCmd(t, "top", "e2e-cli")
	if err != nil {
		t.Fatalf("top: %v\n%s", err, out)
	}
	want := regexp.MustCompile(`(?s)^KEY +POLICY +RECENT REFUSALS +LAST REFUSED +COUNT +REFUSED +REMAINING +RESETS IN +LIMITED\n` +
		`203\.0\.113\.1 +e2e-cli +2 +[0-9]+s ago +3 +2 +0 +([0-9]+s|1m) +yes\n` +
		`203\.0\.113\.2 +e2e-cli +1 +[0-9]+s ago +3 +1 +0 +([0-9]+s|1m) +yes\n` +
		`2 of 2 keys refused in the last 5m in zone e2e-cli\n$`)
	if !want.MatchString(out) {
		t.Errorf("top printed:\n%s", out)
	}
	out, err = rateLimitCmd(t, "top", "e2e-cli", "--by", "count")
	if err != nil {
		t.Fatalf("top --by count: %v\n%s", err, out)
	}
	want = regexp.MustCompile(`(?s)^KEY +POLICY +COUNT +REFUSED +REMAINING +RESETS IN +LIMITED\n` +
		`203\.0\.113\.1 +e2e-cli +3 +2 +0 +([0-9]+s|1m) +yes\n` +
		`203\.0\.113\.2 +e2e-cli +3 +1 +0 +([0-9]+s|1m) +yes\n` +
		`198\.51\.100\.9 +e2e-cli +1 +0 +2 +([0-9]+s|1m) +no\n` +
		`3 of 3 keys in zone e2e-cli\n$`)
	if !want.MatchString(out) {
		t.Errorf("top --by count printed:\n%s", out)
	}
	out, err = rateLimitCmd(t, "top", "e2e-cli", "--limited", "--prefix", "203.0.113.", "-n", "1")
	if err != nil || !strings.Contains(out, "203.0.113.1 ") || strings.Contains(out, "203.0.113.2") || !strings.Contains(out, "1 of 2 keys") {
		t.Errorf("top --limited --prefix -n 1: %v\n%s", err, out)
	}
	out, err = rateLimitCmd(t, "top", "e2e-cli", "--by", "count", "--json")
	var list keyList
	if err != nil || json.Unmarshal([]byte(out), &list) != nil || list.Total != 3 {
		t.Errorf("top --json: %v\n%s", err, out)
	}

	out, err = rateLimitCmd(t, "unblock", "e2e-cli-keys", "key:"+hostileKey)
	if err != nil || out != "unblocked key:"+hostileKey+" in zone e2e-cli-keys\n" {
		t.Errorf("unblock: %v\n%s", err, out)
	}
	wantSitesAliveAt(t, s, "/keyed", "X-Key", hostileKey)
	out, err = rateLimitCmd(t, "unblock", "e2e-cli", "203.0.113.1")
	if err != nil {
		t.Errorf("unblock 203.0.113.1: %v\n%s", err, out)
	}
	if resp, _ := s.get("/", "X-Forwarded-For", "203.0.113.1"); resp.StatusCode != http.StatusOK {
		t.Errorf("203.0.113.1 after unblock: %d, want 200", resp.StatusCode)
	}

	for _, args := range [][]string{
		{"unblock", "e2e-cli", "192.0.2.200"},
		{"top", "no-such-zone"},
		{"top", "e2e-cli", "-n", "0"},
		{"top", "e2e-cli", "--by", "key"},
	} {
		out, err := rateLimitCmd(t, args...)
		var exit *exec.ExitError
		if !errors.As(err, &exit) || !regexp.MustCompile(`not tracked|unknown rate limit zone|invalid -n 0|invalid --by "key"`).MatchString(out) {
			t.Errorf("%v: %v, want a failing exit with the reason\n%s", args, err, out)
		}
	}
}

// wantSitesAliveAt fails the test unless the running config is intact and a
// request to path with the given headers is admitted.
func wantSitesAliveAt(t *testing.T, s *server, path string, headers ...string) {
	t.Helper()
	if status, cfg := admin(t, http.MethodGet, "/config/"); status != http.StatusOK || !strings.Contains(cfg, "e2e-cli") {
		t.Fatalf("GET /config/: %d, want the running config", status)
	}
	if resp, _ := s.get(path, headers...); resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s after unblock: %d, want 200", path, resp.StatusCode)
	}
}

// caddy rate-limit override sets, lists and removes a key's override
// against a real Caddy, and the key runs with it; what the API refuses
// exits non-zero with its message.
func TestCommandLineOverrides(t *testing.T) {
	zone := fresh("e2e-cli-overrides")
	s := startCaddy(t, "", plansSite(zone, "		k-1 free one"))
	out, err := rateLimitCmd(t, "override", "set", zone, "key:k-1", "--plan", "pro")
	if err != nil || out != "override of key:k-1 in zone "+zone+": plan pro\n" {
		t.Fatalf("override set --plan: %v\n%s", err, out)
	}
	if resp, body := s.get("/", "X-API-Key", "k-1"); resp.StatusCode != http.StatusOK || body != "pro 4" {
		t.Errorf("k-1 after its override: %d %q, want pro 4", resp.StatusCode, body)
	}
	out, err = rateLimitCmd(t, "override", "set", zone, "key:"+hostileKey, "--max", "9", "--limit", "hourly=off", "--limit", "tenant=30", "--ttl", "1h")
	if err != nil || !regexp.MustCompile(`^override of key:/\.\./\.\./\.\./config/ in zone \S+: max=9 hourly=off tenant=30 until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\n$`).MatchString(out) {
		t.Fatalf("override set --max --limit --ttl: %v\n%s", err, out)
	}
	out, err = rateLimitCmd(t, "override", "list", zone)
	if err != nil {
		t.Fatalf("override list: %v\n%s", err, out)
	}
	want := regexp.MustCompile(`^KEY +PLAN +VALUES +EXPIRES IN
key:/\.\./\.\./\.\./config/ +- +max=9 hourly=off tenant=30 +(59m5\ds|1h)
key:k-1 +pro +- +never
2 overrides in zone \S+ \(at most 10000\)
$`)
	if !want.MatchString(out) {
		t.Errorf("override list:\n%s", out)
	}
	if out, err = rateLimitCmd(t, "override", "rm", zone, "key:k-1"); err != nil || out != "removed the override of key:k-1 in zone "+zone+"\n" {
		t.Errorf("override rm: %v\n%s", err, out)
	}
	for _, args := range [][]string{
		{"override", "rm", zone, "key:k-1"},
		{"override", "set", zone, "k-1", "--plan", "pro"},
		{"override", "set", zone, "key:k-1", "--limit", "hourly"},
	} {
		out, err := rateLimitCmd(t, args...)
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 1 || !strings.Contains(out, "Error: ") {
			t.Errorf("%v: %v\n%s; want exit 1 with an error", args, err, out)
		}
	}
	if out, _ := rateLimitCmd(t, "override", "list", zone, "--json"); !strings.Contains(out, `"key":"key:/../../../config/"`) || strings.Contains(out, "k-1") {
		t.Errorf("override list --json: %s", out)
	}
}
