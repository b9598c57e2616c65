package tests

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// hostileKey is what an attacker sends as its API key: a path that, put in
// an admin URL as it is, walks up to Caddy's /config/.
const hostileKey = "/../../../config/"

// twoSites is a config of two sites on one port, told apart by Host; the
// first limits by an API key header to one request per minute in the zone
// named by the argument.
func twoSites(zone string) string {
	return fmt.Sprintf(`
http://api.test:$PORT {
	rate_limit {
		zone %s
		key {http.request.header.X-API-Key}
		max 1
	}
	respond "api"
}
http://www.test:$PORT {
	respond "www"
}`, zone)
}

// hostGet sends a GET of / to the site host and returns the status and body.
func hostGet(s *server, host string, headers ...string) (int, string) {
	s.t.Helper()
	resp, body := s.getHost(host, "/", headers...)
	return resp.StatusCode, body
}

// wantSitesAlive fails the test unless both sites answer and the running
// config still holds them.
func wantSitesAlive(t *testing.T, s *server) {
	t.Helper()
	if status, body := hostGet(s, "www.test"); status != http.StatusOK || body != "www" {
		t.Fatalf("www.test: %d %q, want 200 www", status, body)
	}
	status, cfg := admin(t, http.MethodGet, "/config/")
	if status != http.StatusOK || !strings.Contains(cfg, "api.test") || !strings.Contains(cfg, "www.test") {
		t.Fatalf("GET /config/: %d %.200s, want the running config with both sites", status, cfg)
	}
}

// blockHostile makes the hostile key go over its limit.
func blockHostile(t *testing.T, s *server) {
	t.Helper()
	hostGet(s, "api.test", "X-API-Key", hostileKey)
	if status, _ := hostGet(s, "api.test", "X-API-Key", hostileKey); status != http.StatusTooManyRequests {
		t.Fatalf("hostile key's second request: %d, want 429", status)
	}
}

// curl runs the curl command line with args and returns what it printed.
func curl(t *testing.T, args ...string) string {
	t.Helper()
	if _, err := exec.LookPath("curl"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("curl is not installed; .ci/run installs it")
		}
		t.Skip("curl is not installed")
	}
	out, err := exec.Command("curl", append([]string{"-sS", "--max-time", "10"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("curl %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// A client whose key is a path up to /config/ is blocked; the operator
// copies the listed unblock path into curl, into curl with -L, into a client
// that follows redirects, and pastes the raw key into the documented query:
// every time the key is unblocked, and the config and both sites survive.
func TestHostileKeyCannotSteerAdmin(t *testing.T) {
	curl(t, "--version") // the subtests' curl runs with this test's t: skip (or fail in CI) here, not in them
	s := startCaddy(t, "", twoSites("e2e-hostile"))
	adminURL := fmt.Sprintf("http://localhost:%d", adminPort)
	blockHostile(t, s)

	var list keyList
	adminJSON(t, "/rate_limit/e2e-hostile", &list)
	if len(list.Keys) != 1 || list.Keys[0].Key != "key:"+hostileKey {
		t.Fatalf("listing = %+v, want the key key:%s", list, hostileKey)
	}
	unblock := list.Keys[0].Unblock
	if want := "/rate_limit/e2e-hostile?key=key%3A%2F..%2F..%2F..%2Fconfig%2F"; unblock != want {
		t.Fatalf("unblock = %q, want %q", unblock, want)
	}

	for _, tc := range []struct {
		name    string
		unblock func() string
	}{
		{"curl", func() string { return curl(t, "-X", "DELETE", adminURL+unblock) }},
		{"curl -L", func() string { return curl(t, "-L", "-X", "DELETE", adminURL+unblock) }},
		{"raw key pasted into the query", func() string {
			return curl(t, "-L", "-X", "DELETE", adminURL+"/rate_limit/e2e-hostile?key=key:"+hostileKey)
		}},
		{"client that follows redirects", func() string {
			_, body := admin(t, http.MethodDelete, unblock)
			return body
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			blockHostile(t, s)
			body := tc.unblock()
			var got map[string]any
			if err := json.Unmarshal([]byte(body), &got); err != nil || got["forgotten"] != true || got["key"] != "key:"+hostileKey {
				t.Fatalf("unblock answered %q, want forgotten key:%s", body, hostileKey)
			}
			wantSitesAlive(t, s)
			if status, body := hostGet(s, "api.test", "X-API-Key", hostileKey); status != http.StatusOK || body != "api" {
				t.Fatalf("hostile key after unblock: %d %q, want 200 api", status, body)
			}
		})
	}

	// The old form, a key in the path, reaches no other route: with its
	// dots escaped it reaches this API, which refuses it.
	for _, path := range []string{
		"/rate_limit/e2e-hostile/key:%2F..%2F..%2F..%2Fconfig%2F",
		"/rate_limit/e2e-hostile/key:%2F%2E%2E%2F%2E%2E%2F%2E%2E%2Fconfig%2F",
		"/rate_limit/%2E%2E",
	} {
		out := curl(t, "-L", "--path-as-is", "-X", "DELETE", "-w", "\n%{http_code}", adminURL+path)
		if !strings.HasSuffix(out, "\n400") || !strings.Contains(out, `{"error":`) {
			t.Errorf("DELETE %s: %q, want a JSON 400", path, out)
		}
	}
	wantSitesAlive(t, s)
}

// Keys that are not printable text (invalid UTF-8 that a listing would show
// as the same U+FFFD, markup) are listed in a form that is exact and can be
// unblocked; markup is listed as text.
func TestNastyKeysListedFaithfully(t *testing.T) {
	s := startCaddy(t, "", twoSites("e2e-nasty"))
	markup := `<img src=x onerror=alert(1)>`
	for _, k := range []string{"\xff\xfe", "\xfe\xff", markup} {
		hostGet(s, "api.test", "X-API-Key", k)
		if status, _ := hostGet(s, "api.test", "X-API-Key", k); status != http.StatusTooManyRequests {
			t.Fatalf("key %q: second request %d, want 429", k, status)
		}
	}
	var list keyList
	adminJSON(t, "/rate_limit/e2e-nasty", &list)
	keys := map[string]keyInfo{}
	for _, k := range list.Keys {
		keys[k.Key] = k
	}
	hashed := 0
	for k := range keys {
		if strings.HasPrefix(k, "key:sha256:") && len(k) == len("key:sha256:")+32 {
			hashed++
		}
	}
	if len(keys) != 3 || hashed != 2 || keys["key:"+markup].Key == "" {
		t.Fatalf("listing = %+v, want two distinct hashes and the markup as text", list)
	}
	if _, body := admin(t, http.MethodGet, "/rate_limit/e2e-nasty"); strings.Contains(body, "<img") {
		t.Errorf("the listing's JSON holds raw markup: %s", body)
	}
	// Unblocking one hash unblocks that client only.
	var first string
	for k, ki := range keys {
		if strings.HasPrefix(k, "key:sha256:") {
			first = ki.Unblock
			break
		}
	}
	if status, body := admin(t, http.MethodDelete, first); status != http.StatusOK {
		t.Fatalf("DELETE %s: %d %s", first, status, body)
	}
	admitted := 0
	for _, k := range []string{"\xff\xfe", "\xfe\xff"} {
		if status, _ := hostGet(s, "api.test", "X-API-Key", k); status == http.StatusOK {
			admitted++
		}
	}
	if admitted != 1 {
		t.Errorf("%d of the two hashed clients admitted after one unblock, want 1", admitted)
	}
}

// The admin API parses its query strictly and answers every error under
// /rate_limit/ in JSON; /rate_limit without its slash lists the zones.
func TestAdminInputStrict(t *testing.T) {
	s := startCaddy(t, "", twoSites("e2e-strict"))
	blockHostile(t, s)
	for _, tc := range []struct{ method, path, text string }{
		{http.MethodGet, "/rate_limit/e2e-strict?q=203.0.113.%", `malformed query parameter \"q\"`},
		{http.MethodGet, "/rate_limit/e2e-strict?limited=true;", `malformed query parameter \"limited=true;\"`},
		{http.MethodGet, "/rate_limit/e2e-strict?offset=1;limit=1", `malformed query parameter \"offset=1;limit=1\"`},
		{http.MethodGet, "/rate_limit/e2e-strict?q=x&bogus=%", `unknown query parameter \"bogus\"`},
		{http.MethodGet, "/rate_limit/e2e-strict?limit=1&limit=2", `query parameter \"limit\" given more than once`},
		{http.MethodGet, "/rate_limit/e2e-strict?limited=1", `invalid limited \"1\"`},
		{http.MethodGet, "/rate_limit/?zone=x", `unknown query parameter \"zone\"`},
		{http.MethodDelete, "/rate_limit/e2e-strict?key=a&key=b", `query parameter \"key\" given more than once`},
		{http.MethodDelete, "/rate_limit/e2e-strict", `missing query parameter key`},
		{http.MethodGet, "/rate_limit/e2e-strict/x", `a key goes in the query`},
		{http.MethodGet, "/rate_limit/%2E", `invalid path`},
	} {
		status, body := admin(t, tc.method, tc.path)
		if status != http.StatusBadRequest || !strings.HasPrefix(body, `{"error":`) || !strings.Contains(body, tc.text) {
			t.Errorf("%s %s: %d %s, want a JSON 400 with %s", tc.method, tc.path, status, body, tc.text)
		}
	}
	var zones []map[string]any
	adminJSON(t, "/rate_limit", &zones)
	if len(zones) == 0 {
		t.Errorf("GET /rate_limit: no zones")
	}
}

// load posts a Caddyfile to the admin endpoint's /load, as a reload would,
// and returns the status and body.
func (s *server) load(site string) (int, string) {
	s.t.Helper()
	cfg := fmt.Sprintf(globals, adminPort, s.Port, freePort(), "") + strings.ReplaceAll(site, "$PORT", strconv.Itoa(s.Port))
	req, err := http.NewRequest(http.MethodPost, fmt.Sprintf("http://localhost:%d/load", adminPort), bytes.NewBufferString(cfg))
	if err != nil {
		s.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "text/caddyfile")
	resp, err := client.Do(req)
	if err != nil {
		s.t.Fatalf("POST /load: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// A reload with an option Caddy would otherwise default silently fails,
// naming the option and the value, and the running config keeps serving.
func TestConfigInputStrict(t *testing.T) {
	s := startCaddy(t, "", twoSites("e2e-config"))
	for _, tc := range []struct{ opts, text string }{
		{`store redis {
			address 127.0.0.1:6379
			hash_keys ""
		}`, `invalid hash_keys \"\": must not be empty`},
		{`store redis {
			address 127.0.0.1:6379
			key_prefix ""
		}`, `invalid key_prefix \"\": must not be empty`},
		{`zone ""`, `invalid zone \"\": must not be empty`},
		{`key ""`, `invalid key \"\": must not be empty`},
		{`key {http.request.header.X`, `placeholder at offset 0 is not closed`},
		{`enabled 0`, `invalid enabled \"0\": must be true or false`},
		{`enabled 1`, `invalid enabled \"1\"`},
		{`enabled T`, `invalid enabled \"T\"`},
		{"zone a\n\t\tzone b", `option zone given twice`},
		{"window 60\n\t\twindowS 60", `option window given twice (as window and windowS)`},
		{`store redis {
			address 127.0.0.1:0
		}`, `invalid redis address \"127.0.0.1:0\": port must be a number from 1 to 65535`},
		{`store redis {
			address 127.0.0.1
		}`, `invalid redis address \"127.0.0.1\": must be host:port`},
		{`store redis {
			url redis://127.0.0.1:6379/-1
		}`, `invalid db -1: must be 0 or more`},
		{`store redis {
			address 127.0.0.1:6379
			timeout 500us
		}`, `invalid timeout 500µs: must be at least 1ms`},
		{`max 9223372036854775807`, `invalid max 9223372036854775807: must be from 1 to 1000000000`},
	} {
		status, body := s.load(fmt.Sprintf("http://api.test:$PORT {\n\trate_limit {\n\t\t%s\n\t}\n\trespond \"api\"\n}", tc.opts))
		if status != http.StatusBadRequest || !strings.Contains(body, tc.text) {
			t.Errorf("%s: %d %s, want 400 naming %s", tc.opts, status, body, tc.text)
		}
	}
	wantSitesAlive(t, s)
}

// memoryAndRedis is a site with a memory zone at /memory and a Redis zone
// at /redis, named prefix-memory and prefix-redis, each max per window.
func memoryAndRedis(prefix, window string, max int, redisAddr string) string {
	return fmt.Sprintf(`
:$PORT {
	handle /memory {
		rate_limit {
			zone %[1]s-memory
			window %[2]s
			max %[3]d
		}
		respond "ok"
	}
	handle /redis {
		rate_limit {
			zone %[1]s-redis
			window %[2]s
			max %[3]d
			store redis {
				address %[4]s
				timeout 5s
			}
		}
		respond "ok"
	}
}`, prefix, window, max, redisAddr)
}

// A reload that shortens the window refuses no key for longer than the new
// window from the reload, however often the key comes back, in memory and in
// Redis; the listing shows the new reset at once. The key is still refused
// right after the reload (its count survives it), every refusal names the
// new end, and the key is admitted to a whole new window once it has passed,
// long before the old window of two minutes would have ended.
func TestShortenedWindowEndsAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	site := func(window string) string { return memoryAndRedis("e2e-shorten", window, 2, srv.Addr) }
	s := startCaddy(t, "", site("120"))
	paths := []string{"/memory", "/redis"}
	for _, p := range paths {
		for i := range 3 {
			resp, _ := s.get(p)
			if want := map[bool]int{true: 200, false: 429}[i < 2]; resp.StatusCode != want {
				t.Fatalf("%s request %d: %d, want %d", p, i+1, resp.StatusCode, want)
			}
		}
	}
	s.reload("", site("1"))
	reloaded := time.Now()
	latest := reloaded.Add(time.Second).Unix() + 1

	// refusedByNewWindow fails the test unless resp is a 429 that ends
	// within the new window.
	refusedByNewWindow := func(p string, resp *http.Response) {
		t.Helper()
		retry, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		reset, _ := strconv.ParseInt(resp.Header.Get("X-RateLimit-Reset"), 10, 64)
		if resp.StatusCode != http.StatusTooManyRequests || retry != 1 || reset > latest {
			t.Fatalf("%s %s after the reload: %d, Retry-After %q, reset %d; want 429 ending by %d",
				p, time.Since(reloaded).Round(time.Millisecond), resp.StatusCode, resp.Header.Get("Retry-After"), reset, latest)
		}
	}
	for _, p := range paths {
		resp, _ := s.get(p)
		refusedByNewWindow(p, resp)
	}
	for _, zone := range []string{"e2e-shorten-memory", "e2e-shorten-redis"} {
		var list keyList
		adminJSON(t, "/rate_limit/"+zone, &list)
		if len(list.Keys) != 1 || list.Keys[0].Reset > latest {
			t.Fatalf("%s listing after the reload = %+v, want one key resetting by %d", zone, list, latest)
		}
	}

	// The key keeps coming back until it is admitted; a refusal counts
	// nothing, so the window it is admitted to is whole.
	admitted := map[string]bool{}
	comesBack := func() bool {
		for _, p := range paths {
			if admitted[p] {
				continue
			}
			resp, _ := s.get(p)
			if resp.StatusCode == http.StatusOK {
				wantHeader(t, resp, "X-RateLimit-Remaining", "1")
				admitted[p] = true
				continue
			}
			refusedByNewWindow(p, resp)
		}
		return len(admitted) == len(paths)
	}
	if !eventuallyAcross(comesBack) {
		t.Fatalf("admitted %v %s after the reload to a 1s window, want both", admitted, time.Since(reloaded).Round(time.Millisecond))
	}
}

// Behind a proxy that appends to X-Forwarded-For, a client that sends its own
// header picks its key unless trusted_proxies_strict is set; with it, the key
// is the address the proxy saw, as docs/security.md says.
func TestTrustedProxiesStrict(t *testing.T) {
	site := clientIPSite
	// The test client plays the proxy (127.0.0.1, trusted) that appended
	// the client's real address, 203.0.113.50, to what the client sent.
	forwarded := func(spoofed string) string { return spoofed + ", 203.0.113.50" }
	lax := startCaddy(t, "servers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}", fmt.Sprintf(site, "e2e-xff-lax"))
	for i := range 4 {
		resp, body := lax.get("/", "X-Forwarded-For", forwarded(fmt.Sprintf("198.51.100.%d", i)))
		if resp.StatusCode != http.StatusOK || body != fmt.Sprintf("198.51.100.%d", i) {
			t.Fatalf("without strict, request %d: %d, client_ip %q; want the spoofed address admitted", i+1, resp.StatusCode, body)
		}
	}
	strict := startCaddy(t, "servers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t\ttrusted_proxies_strict\n\t}", fmt.Sprintf(site, "e2e-xff-strict"))
	for i := range 3 {
		resp, body := strict.get("/", "X-Forwarded-For", forwarded(fmt.Sprintf("198.51.100.%d", i)))
		want := map[bool]int{true: http.StatusOK, false: http.StatusTooManyRequests}[i < 2]
		if resp.StatusCode != want || (want == http.StatusOK && body != "203.0.113.50") {
			t.Fatalf("with strict, request %d: %d, client_ip %q; want %d keyed by 203.0.113.50", i+1, resp.StatusCode, body, want)
		}
	}
}

// A window that a reload shortens ends a new window after the reload even
// when the key comes back in the last part of its old window (where the
// old end is within a new window of the request): in memory at once, in
// Redis once the first request after the reload has started the cut.
//
// The key must come back after the new end and before the old one, and no
// earlier (a request before the last part of the old window would cut its
// window itself): with a 3s window cut to 1s, that is one sleep to a point
// in the last second of the old window. A reload so slow that the point
// has passed leaves nothing tested, so the scenario runs again in fresh
// zones, and fails after three tries rather than pass untested.
func TestShortenedWindowNearItsEnd(t *testing.T) {
	srv := redistest.Start(t)
	paths := []string{"/memory", "/redis"}
	var s *server
	for try := 1; try <= 3; try++ {
		site := func(window string) string {
			return memoryAndRedis(fmt.Sprintf("e2e-near%d", try), window, 1, srv.Addr)
		}
		if s == nil {
			s = startCaddy(t, trustLoopback, site("3"))
		} else {
			s.reload(trustLoopback, site("3"))
		}
		began := time.Now()
		for _, p := range paths {
			s.get(p, "X-Forwarded-For", "203.0.113.60")
			if resp, _ := s.get(p, "X-Forwarded-For", "203.0.113.60"); resp.StatusCode != http.StatusTooManyRequests {
				t.Fatalf("%s second request: %d, want 429", p, resp.StatusCode)
			}
		}
		blocked := time.Now()
		s.reload(trustLoopback, site("1"))
		reloaded := time.Now()
		// Another client's request starts the Redis cut.
		for _, p := range paths {
			s.get(p, "X-Forwarded-For", "198.51.100.60")
		}
		// The old windows began after began and before blocked, so they
		// end between began+3s and blocked+3s; cut, they end by
		// reloaded+1s. Come back once both the new end and the start of
		// the old window's last second have passed.
		oldEnd := began.Add(3 * time.Second)
		comeBack := reloaded.Add(time.Second)
		if last := blocked.Add(2 * time.Second); last.After(comeBack) {
			comeBack = last
		}
		comeBack = comeBack.Add(50 * time.Millisecond)
		time.Sleep(time.Until(comeBack))
		var statuses []int
		for _, p := range paths {
			resp, _ := s.get(p, "X-Forwarded-For", "203.0.113.60")
			statuses = append(statuses, resp.StatusCode)
		}
		if done := time.Now(); done.After(oldEnd) {
			t.Logf("try %d: the reload took %s and the key came back %s after the old windows began: past their end, so untested",
				try, reloaded.Sub(blocked).Round(time.Millisecond), done.Sub(began).Round(time.Millisecond))
			continue
		}
		for i, p := range paths {
			if statuses[i] != http.StatusOK {
				t.Errorf("%s %s after the reload: %d, want 200 (the old window ends %s after it)",
					p, comeBack.Sub(reloaded).Round(time.Millisecond), statuses[i], oldEnd.Sub(reloaded).Round(time.Millisecond))
			}
		}
		return
	}
	t.Fatal("three tries found no time between the new end and the old one: blocking the key and reloading took nearly two seconds each time")
}
