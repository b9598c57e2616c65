package tests

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
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
