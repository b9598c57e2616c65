package tests

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// consoleHash is the bcrypt hash of consolePassword (cost 4: fast enough
// for a test that checks it on every request).
const (
	consoleUser     = "ops"
	consolePassword = "console-secret"
	consoleHash     = "$2a$04$5MceBzf5OHZKFeaUuaHOZeltXmC.ZhpF035SmlOyiJCpJKnZAXs66"
)

// consoleSite is a site with a limited route and the console under
// /rate-limits behind basic_auth, a read-only one under /view, and one
// mounted with handle_path under /mounted.
const consoleSite = `
:$PORT {
	route /app {
		rate_limit {
			zone %s
			window 60
			max 1
		}
		respond "app"
	}
	basic_auth /rate-limits* {
		%s %s
	}
	rate_limit_console /rate-limits*
	route /view* {
		rate_limit_console {
			read_only
		}
	}
	handle_path /mounted* {
		rate_limit_console
	}
}`

// consoleDo sends method to the site's path with the console's credentials
// and headers (name, value pairs), and returns the status, the headers and
// the body.
func consoleDo(t *testing.T, s *server, method, path string, headers ...string) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(method, s.Base+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.SetBasicAuth(consoleUser, consolePassword)
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	noRedirect := *client
	noRedirect.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	resp, err := noRedirect.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(body)
}

// The console serves the dashboard and the admin API's JSON in a site,
// behind its basic_auth: the page at the base (a path without the slash
// redirects there, relative to what was typed), zones and keys below api/,
// an unblock by DELETE from the site itself only, none when read_only.
func TestConsoleSiteHandler(t *testing.T) {
	zone := "e2e-console"
	s := startCaddy(t, trustLoopback, fmt.Sprintf(consoleSite, zone, consoleUser, consoleHash))
	for range 3 {
		request(t, s.Base, "/app", "X-Forwarded-For", "198.51.100.120")
	}

	// Without credentials: the site's authentication answers.
	resp := request(t, s.Base, "/rate-limits/")
	wantStatus(t, resp, http.StatusUnauthorized)

	for _, tc := range []struct{ path, location string }{
		{"/rate-limits", "./rate-limits/"},
		{"/mounted", "./mounted/"},
		{"/view?x=1", "./view/?x=1"},
	} {
		status, h, _ := consoleDo(t, s, http.MethodGet, tc.path)
		if status != http.StatusPermanentRedirect || h.Get("Location") != tc.location {
			t.Errorf("GET %s: %d, Location %q; want 308 to %q", tc.path, status, h.Get("Location"), tc.location)
		}
	}
	for _, base := range []string{"/rate-limits/", "/mounted/", "/view/"} {
		status, h, body := consoleDo(t, s, http.MethodGet, base)
		if status != http.StatusOK || !strings.Contains(body, `data-api="./api/"`) || !strings.Contains(h.Get("Content-Security-Policy"), "connect-src 'self'") {
			t.Fatalf("GET %s: %d, CSP %q; want the page, reading ./api/ under its CSP", base, status, h.Get("Content-Security-Policy"))
		}
		status, h, body = consoleDo(t, s, http.MethodGet, base+"api/")
		wantPrivateJSON(t, "GET "+base+"api/", h)
		var zones []struct {
			Name string `json:"name"`
		}
		if status != http.StatusOK || json.Unmarshal([]byte(body), &zones) != nil || !strings.Contains(body, `"name":"`+zone+`"`) {
			t.Fatalf("GET %sapi/: %d %s; want the zone list with %s", base, status, body, zone)
		}
		status, h, body = consoleDo(t, s, http.MethodGet, base+"api/"+zone)
		if status != http.StatusOK || !strings.Contains(body, `"key":"198.51.100.120"`) {
			t.Fatalf("GET %sapi/%s: %d %s; want the key listed", base, zone, status, body)
		}
		wantPrivateJSON(t, "GET "+base+"api/"+zone, h)
	}

	unblock := "/rate-limits/api/" + zone + "?key=198.51.100.120"
	// Same origin is the Fetch standard's: scheme, host and port, the
	// scheme the one the client used (X-Forwarded-Proto counts only from
	// a trusted proxy, see TestConsoleBehindTLSProxy).
	hostPort := strings.TrimPrefix(s.Base, "http://")
	for _, headers := range [][]string{
		{"Sec-Fetch-Site", "cross-site"},
		{"Sec-Fetch-Site", "same-site"},
		{"Origin", "http://evil.example"},
		{"Origin", "null"},
		{"Origin", ""},
		{"Origin", "https://" + hostPort},
		{"Origin", "http://127.0.0.1:1"},
		{"Origin", "http://127.0.0.1"},
		{"Origin", s.Base + "/rate-limits/"},
		{"Origin", "http://user@" + hostPort},
	} {
		status, h, body := consoleDo(t, s, http.MethodDelete, unblock, headers...)
		if status != http.StatusForbidden || !strings.Contains(body, `"error":"cross-site request refused`) {
			t.Errorf("DELETE with %q: %d %s; want 403 cross-site", headers, status, body)
		}
		wantPrivateJSON(t, fmt.Sprintf("DELETE with %q", headers), h)
	}
	if status, _, body := consoleDo(t, s, http.MethodGet, unblock); status != http.StatusBadRequest {
		t.Fatalf("GET %s: %d %s; want 400 (unblock only by DELETE)", unblock, status, body)
	}
	wantStatus(t, request(t, s.Base, "/app", "X-Forwarded-For", "198.51.100.120"), http.StatusTooManyRequests)
	status, _, body := consoleDo(t, s, http.MethodDelete, "/view/api/"+zone+"?key=198.51.100.120", "Sec-Fetch-Site", "same-origin")
	if status != http.StatusForbidden || !strings.Contains(body, "read_only") {
		t.Fatalf("DELETE through the read_only console: %d %s; want 403", status, body)
	}
	// Overrides follow the same rules: read only, and same-site only.
	for _, method := range []string{http.MethodPut, http.MethodDelete} {
		status, _, body := consoleDo(t, s, method, "/view/api/"+zone+"/overrides?key=198.51.100.120", "Sec-Fetch-Site", "same-origin")
		if status != http.StatusForbidden || !strings.Contains(body, "read_only") {
			t.Errorf("%s of an override through the read_only console: %d %s; want 403", method, status, body)
		}
		status, _, body = consoleDo(t, s, method, "/rate-limits/api/"+zone+"/overrides?key=198.51.100.120", "Sec-Fetch-Site", "cross-site")
		if status != http.StatusForbidden || !strings.Contains(body, "cross-site request refused") {
			t.Errorf("cross-site %s of an override: %d %s; want 403", method, status, body)
		}
	}
	if status, _, body := consoleDo(t, s, http.MethodGet, "/view/api/"+zone+"/overrides"); status != http.StatusOK || !strings.Contains(body, `"overrides":[]`) {
		t.Errorf("GET the overrides through the read_only console: %d %s; want none listed", status, body)
	}
	wantStatus(t, request(t, s.Base, "/app", "X-Forwarded-For", "198.51.100.120"), http.StatusTooManyRequests)

	status, h, body := consoleDo(t, s, http.MethodDelete, unblock, "Sec-Fetch-Site", "same-origin", "Origin", s.Base)
	if status != http.StatusOK || !strings.Contains(body, `"forgotten":true`) {
		t.Fatalf("DELETE from the site: %d %s; want the key forgotten", status, body)
	}
	wantPrivateJSON(t, "DELETE from the site", h)
	wantStatus(t, request(t, s.Base, "/app", "X-Forwarded-For", "198.51.100.120"), http.StatusOK)
	status, h, body = consoleDo(t, s, http.MethodGet, "/rate-limits/api/no-such-zone")
	if status != http.StatusNotFound || !strings.Contains(body, `"error":"unknown rate limit zone`) {
		t.Fatalf("GET an unknown zone: %d %s; want a JSON 404", status, body)
	}
	wantPrivateJSON(t, "GET an unknown zone", h)
}

// Behind a trusted proxy that terminates TLS, the browser's origin is
// https: the console takes the scheme from X-Forwarded-Proto and allows
// an unblock from its own origin, and still refuses another scheme. From
// a peer that is not a trusted proxy the header counts for nothing.
func TestConsoleBehindTLSProxy(t *testing.T) {
	zone := "e2e-console-tls"
	s := startCaddy(t, trustLoopback, fmt.Sprintf(consoleSite, zone, consoleUser, consoleHash))
	hostPort := strings.TrimPrefix(s.Base, "http://")
	unblock := "/rate-limits/api/" + zone + "?key=198.51.100.121"
	for _, tc := range []struct {
		origin, proto string
		status        int
	}{
		{"http://" + hostPort, "https", http.StatusForbidden},
		{"https://" + hostPort, "http", http.StatusForbidden},
		{"https://" + hostPort, "", http.StatusForbidden},
		{"https://" + hostPort, "https", http.StatusOK},
	} {
		request(t, s.Base, "/app", "X-Forwarded-For", "198.51.100.121")
		status, _, body := consoleDo(t, s, http.MethodDelete, unblock, "Origin", tc.origin, "X-Forwarded-Proto", tc.proto)
		if status != tc.status {
			t.Errorf("DELETE with Origin %s, X-Forwarded-Proto %q: %d %s; want %d", tc.origin, tc.proto, status, body, tc.status)
		}
	}

	s.reload("", fmt.Sprintf(consoleSite, zone, consoleUser, consoleHash)) // no trusted proxies
	request(t, s.Base, "/app")
	status, _, body := consoleDo(t, s, http.MethodDelete, "/rate-limits/api/"+zone+"?key=127.0.0.1",
		"Origin", "https://"+hostPort, "X-Forwarded-Proto", "https")
	if status != http.StatusForbidden {
		t.Errorf("DELETE from an untrusted peer claiming https: %d %s; want 403", status, body)
	}
}

// The console in a real browser, opened directly at the site's path (no
// proxy, no header stripping): it shows the zone and, first among the
// offenders, a key refused 28 times by a one-second limit after that window
// has ended (the default order of the admin API would list it last, with
// nothing refused), and its Unblock button forgets the key.
func TestConsoleInBrowser(t *testing.T) {
	ctx := browser(t)
	zone := "e2e-console-ui"
	clk := fakeClock(t, zone)
	s := startCaddy(t, trustLoopbackStrict, fmt.Sprintf(`
:$PORT {
	route /app {
		rate_limit {
			zone %s
			window 60
			max 5
			limit burst 2 1
		}
		respond "app"
	}
	rate_limit_console /rate-limits*
}`, zone))
	const offender = "198.51.100.130"
	hit := func(ip string) int {
		return request(t, s.Base, "/app", "X-Forwarded-For", ip).StatusCode
	}
	refused := 0
	for range 30 {
		if hit(offender) == http.StatusTooManyRequests {
			refused++
		}
	}
	if refused != 28 {
		t.Fatalf("%d of 30 requests refused, want 28 (the burst limit admits 2 a second)", refused)
	}
	for _, calm := range []string{"198.51.100.131", "198.51.100.132"} {
		for range 2 {
			if got := hit(calm); got != http.StatusOK {
				t.Fatalf("calm client %s: %d, want 200", calm, got)
			}
		}
	}
	// The one-second window ends: its refusals go with it.
	clk.Advance(time.Second)
	if got := listingOf(t, zone)["burst/"+offender]; got != "" {
		t.Fatalf("the offender's burst window never ended: %q", listingOf(t, zone)["burst/"+offender])
	}

	if err := chromedp.Do(ctx, chromedp.Navigate(s.Base+"/rate-limits")); err != nil {
		t.Fatal(err)
	}
	waitJS(t, ctx, `!!document.querySelector('#zones tbody tr[data-zone="`+zone+`"]')`, "the zone")
	first := `document.querySelector('#keys tbody tr')`
	waitJS(t, ctx, `!!`+first+` && `+first+`.dataset.key === "`+offender+`"`, "the offender first")
	cells, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`Array.from(`+first+`.cells).map((c) => c.textContent)`))
	if err != nil {
		t.Fatal(err)
	}
	if len(cells) < 9 || cells[1] != "burst" || cells[7] != "28" {
		t.Fatalf("first offender row = %q, want the key, refused last by burst, 28 recent refusals", cells)
	}
	url, err := chromedp.Run(ctx, chromedp.Evaluate[string](`location.pathname`))
	if err != nil || url != "/rate-limits/" {
		t.Fatalf("the page is at %q (%v), want /rate-limits/ after the redirect", url, err)
	}
	if shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100)); err == nil && os.MkdirAll("artifacts", 0o755) == nil {
		if os.WriteFile(filepath.Join("artifacts", "console.png"), shot, 0o644) == nil {
			t.Logf("screenshot: tests/artifacts/console.png (%d bytes)", len(shot))
		}
	}
	if _, err := chromedp.Run(ctx, chromedp.Evaluate[bool](first+`.querySelector('button.unblock').click() || true`)); err != nil {
		t.Fatal(err)
	}
	row := `Array.from(document.querySelectorAll('#keys tbody tr')).find((r) => r.dataset.key === "` + offender + `")`
	waitJS(t, ctx, `!(`+row+`) && document.querySelector('#error').hidden`, "the offender gone after unblock")
	if got := listingOf(t, zone)[zone+"/"+offender]; got != "" {
		t.Fatalf("after the unblock the offender is listed as %q, want forgotten", got)
	}
}

// The console's overrides in a real browser: the form sets one (the key
// then runs with its plan), a key that is markup shows as text and runs
// nothing, and Remove takes an override away.
func TestConsoleOverridesInBrowser(t *testing.T) {
	ctx := browser(t)
	zone := fresh("e2e-console-overrides")
	site := plansSite(zone, "		k-1 free one")
	site = strings.Replace(site, ":$PORT {", ":$PORT {\n\thandle /rate-limits* {\n\t\trate_limit_console\n\t}\n\thandle {", 1) + "\n}"
	s := startCaddy(t, "", site)
	if resp, body := s.get("/", "X-API-Key", "k-1"); resp.StatusCode != http.StatusOK || body != "default 2" {
		t.Fatalf("k-1 on the default plan: %d %q", resp.StatusCode, body)
	}
	if status, reply := setOverride(t, zone, `{"key": `+strconv.Quote("key:"+xssKey)+`, "max": 9}`); status != http.StatusOK {
		t.Fatalf("override of the markup key: %d %s", status, reply)
	}
	if err := chromedp.Do(ctx, chromedp.Navigate(s.Base+"/rate-limits/#zone="+zone)); err != nil {
		t.Fatal(err)
	}
	rowOf := func(key string) string {
		return `Array.from(document.querySelectorAll('#override-list tbody tr')).find((r) => r.dataset.key === ` + strconv.Quote(key) + `)`
	}
	waitJS(t, ctx, `!!(`+rowOf("key:"+xssKey)+`)`, "the markup key's override")
	if _, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`(() => {
		document.querySelector('#override-key').value = 'key:k-1';
		document.querySelector('#override-plan').value = 'pro';
		document.querySelector('#override-ttl').value = '1h';
		document.querySelector('#override-form').requestSubmit();
		return true;
	})()`)); err != nil {
		t.Fatal(err)
	}
	waitJS(t, ctx, `!!(`+rowOf("key:k-1")+`)`, "k-1's override")
	cells, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`Array.from(`+rowOf("key:k-1")+`.cells).map((c) => c.textContent)`))
	if err != nil {
		t.Fatal(err)
	}
	if len(cells) != 5 || cells[1] != "pro" || cells[2] != "\u2014" || !regexp.MustCompile(`^(59m5\ds|1h)$`).MatchString(cells[3]) {
		t.Errorf("k-1's override row = %q, want plan pro for 1h", cells)
	}
	if resp, body := s.get("/", "X-API-Key", "k-1"); resp.StatusCode != http.StatusOK || body != "pro 4" {
		t.Errorf("k-1 after the console's override: %d %q, want pro 4", resp.StatusCode, body)
	}
	markup, err := chromedp.Run(ctx, chromedp.Evaluate[string](rowOf("key:"+xssKey)+`.cells[0].textContent + ' ' + !!window.pwned + ' ' + document.querySelectorAll('#override-list img').length`))
	if err != nil || markup != "key:"+xssKey+" false 0" {
		t.Errorf("the markup key's row reads %q (%v), want the key as text, nothing run", markup, err)
	}
	if _, err := chromedp.Run(ctx, chromedp.Evaluate[bool](rowOf("key:k-1")+`.querySelector('button.remove').click() || true`)); err != nil {
		t.Fatal(err)
	}
	waitJS(t, ctx, `!(`+rowOf("key:k-1")+`) && document.querySelector('#error').hidden`, "k-1's override gone")
	if got := overridesOf(t, zone); fmt.Sprint(got) != "[key:"+xssKey+"  9 0]" {
		t.Errorf("overrides after Remove = %v, want the markup key's alone", got)
	}
}
