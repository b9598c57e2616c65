package tests

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
)

// xssKey is a key a client chooses to attack whoever views the dashboard.
const xssKey = `<img src=x onerror="window.pwned=1">`

// chromium returns the path of a headless-capable Chromium, failing in CI
// (which installs it) and skipping elsewhere when there is none.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{os.Getenv("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"} {
		if name == "" {
			continue
		}
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatal("no chromium; .ci/run installs Debian's chromium")
	}
	t.Skip("no chromium installed (apt-get install chromium)")
	return ""
}

// browser starts a headless Chromium for the test and returns its context.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromium(t)),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-quic", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.WindowSize(1280, 900),
	)
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelCtx := chromedp.NewContext(alloc)
	ctx, cancelTimeout := context.WithTimeout(ctx, 90*time.Second)
	t.Cleanup(func() { cancelTimeout(); cancelCtx(); cancelAlloc() })
	return ctx
}

// waitJS evaluates the boolean expression js in the page (a browser's
// process) until it holds, failing the test after 15 s with what the page
// shows.
func waitJS(t *testing.T, ctx context.Context, js, what string) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		// An error (the page still loading) counts as not yet.
		ok, err := chromedp.Run(ctx, chromedp.Evaluate[bool](js))
		if err == nil && ok {
			return
		}
		if time.Now().After(deadline) {
			text, _ := chromedp.Run(ctx, chromedp.Evaluate[string](`document.body.innerText`))
			t.Fatalf("the page never showed %s (last error: %v); it shows:\n%s", what, err, text)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// The dashboard in a real browser, served by a Caddy whose admin endpoint is
// on a unix socket behind a reverse proxy under a path prefix: traffic makes
// an offender appear, its key (markup) shows as text and runs nothing, the
// unblock button removes it and admits the client again, and an admin API
// error shows as a message. The traffic comes through a trusted proxy
// without trusted_proxies_strict, and the zone, whose missing key falls back
// to the client IP, shows the warning. A screenshot is kept in
// tests/artifacts/.
func TestDashboard(t *testing.T) {
	ctx := browser(t)
	sock := filepath.Join(t.TempDir(), "admin.sock")
	port := freePort()
	cfg := fmt.Sprintf(`{
	admin unix/%[1]s
	skip_install_trust
	auto_https off
	http_port %[2]d
	https_port %[3]d
	grace_period 1s
	servers {
		trusted_proxies static 127.0.0.1/32
	}
}
:%[2]d {
	handle /api/* {
		rate_limit {
			zone e2e-ui
			key {http.request.header.X-Key}
			max 2
		}
		respond "ok"
	}
	# The admin endpoint behind a proxy, under a prefix. Caddy's admin
	# endpoint refuses browser requests whose origin it cannot check, so the
	# proxy drops the headers that make it check (put auth in front of it).
	handle_path /ops/* {
		reverse_proxy unix/%[1]s {
			header_up -Origin
			header_up -Referer
			header_up -Sec-Fetch-Mode
		}
	}
	# The page from the same admin endpoint, but every API call fails.
	handle_path /broken/* {
		@page path /rate_limit/ui
		reverse_proxy @page unix/%[1]s {
			header_up -Origin
			header_up -Referer
			header_up -Sec-Fetch-Mode
		}
		@api not path /rate_limit/ui
		respond @api `+"`"+`{"error":"the admin endpoint is down for a test"}`+"`"+` 503
	}
}
`, sock, port, freePort())
	base := runCaddyProcess(t, cfg, port)

	hit := func(key string) int {
		req, _ := http.NewRequest(http.MethodGet, base+"/api/x", nil)
		req.Header.Set("X-Key", key)
		req.Header.Set("X-Forwarded-For", "198.51.100.20")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for range 4 {
		hit(xssKey)
	}
	hit("calm")
	if got := hit(xssKey); got != http.StatusTooManyRequests {
		t.Fatalf("the offender's request: %d, want 429", got)
	}

	if err := chromedp.Do(ctx, chromedp.Navigate(base+"/ops/rate_limit/ui")); err != nil {
		t.Fatal(err)
	}
	keyJSON, _ := json.Marshal("key:" + xssKey)
	row := `Array.from(document.querySelectorAll('#keys tbody tr')).find((r) => r.dataset.key === ` + string(keyJSON) + `)`
	waitJS(t, ctx, `!!(`+row+`)`, "the offender")
	waitJS(t, ctx, `!!document.querySelector('#zones tbody tr[data-zone="e2e-ui"]')`, "the zone")
	waitJS(t, ctx, `!document.querySelector('#spoofable').hidden && document.querySelector('#spoofable').textContent.startsWith('Zone e2e-ui: clients behind a trusted proxy choose their own key.') && document.querySelector('#spoofable').textContent.includes('Set trusted_proxies_strict') && document.querySelector('#zones tbody tr[data-zone="e2e-ui"] .tag-bad').textContent === 'spoofable key'`, "the zone's spoofable key warning")

	cells, err := chromedp.Run(ctx, chromedp.Evaluate[[]string](`Array.from(`+row+`.cells).map((c) => c.textContent)`))
	if err != nil {
		t.Fatal(err)
	}
	if len(cells) < 9 || cells[0] != "key:"+xssKey || cells[1] != "e2e-ui" || cells[2] != "2" || cells[3] != "3" || cells[6] != "yes" ||
		cells[7] != "3" || !regexp.MustCompile(`^[0-9]+s ago$`).MatchString(cells[8]) {
		t.Errorf("offender row = %q, want the key as text, its limit, 2 admitted, 3 refused, limited, 3 refused lately, seconds ago", cells)
	}
	// Listed by recent refusals by default: the calm key was never refused.
	calm, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`!!document.querySelector('#keys tbody tr[data-key="key:calm"]')`))
	if err != nil || calm {
		t.Errorf("the calm key is listed among the offenders (%v)", err)
	}
	window, err := chromedp.Run(ctx, chromedp.Evaluate[string](`document.querySelector('#zones tbody tr[data-zone="e2e-ui"]').cells[3].textContent`))
	if err != nil || window != "1m" {
		t.Errorf("the zone's window reads %q (%v), want 1m", window, err)
	}
	pwned, err := chromedp.Run(ctx, chromedp.Evaluate[bool](`!!window.pwned`))
	if err != nil {
		t.Fatal(err)
	}
	images, err := chromedp.Run(ctx, chromedp.Evaluate[int](`document.querySelectorAll('img').length`))
	if err != nil {
		t.Fatal(err)
	}
	if pwned || images != 0 {
		t.Fatalf("the key was rendered as markup: pwned %t, %d img elements", pwned, images)
	}

	shot, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll("artifacts", 0o755); err == nil {
		if err := os.WriteFile(filepath.Join("artifacts", "dashboard.png"), shot, 0o644); err == nil {
			t.Logf("screenshot: tests/artifacts/dashboard.png (%d bytes)", len(shot))
		}
	}

	if _, err := chromedp.Run(ctx, chromedp.Evaluate[bool](row+`.querySelector('button.unblock').click() || true`)); err != nil {
		t.Fatal(err)
	}
	waitJS(t, ctx, `!(`+row+`) && document.querySelector('#error').hidden`, "the offender gone after unblock")
	if got := hit(xssKey); got != http.StatusOK {
		t.Errorf("the offender after unblock: %d, want 200", got)
	}

	if err := chromedp.Do(ctx, chromedp.Navigate(base+"/broken/rate_limit/ui")); err != nil {
		t.Fatal(err)
	}
	waitJS(t, ctx, `!document.querySelector('#error').hidden && document.querySelector('#error').textContent.includes('503') && document.querySelector('#error').textContent.includes('down for a test')`, "the admin API's error")
}

// Caddy's admin endpoint refuses a browser's own navigation to it (Sec-Fetch
// headers, no Origin, no Referer) before any admin module runs; this is why
// the dashboard is opened through a proxy. If Caddy ever lets it through,
// this test says so.
func TestDashboardDirectNavigationRefusedByCaddy(t *testing.T) {
	startCaddy(t, "", ":$PORT {\n\trespond ok\n}")
	req, _ := http.NewRequest(http.MethodGet, fmt.Sprintf("http://localhost:%d/rate_limit/ui", adminPort), nil)
	req.Header.Set("Sec-Fetch-Mode", "navigate")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("navigation without Origin: %d, want Caddy's 403", resp.StatusCode)
	}
	status, body := admin(t, http.MethodGet, "/rate_limit/ui")
	if status != http.StatusOK || !strings.Contains(body, "<title>Rate limits") {
		t.Errorf("GET /rate_limit/ui: %d %.100s, want the page", status, body)
	}
}
