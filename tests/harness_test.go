// Package tests holds the end-to-end tests: a real Caddy started in this test
// process by caddytest, driven over real sockets. Every test that starts Caddy
// lives in this package so that no two packages fight over Caddy's
// process-global state; each test names its own zones.
package tests

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	_ "github.com/caddy-rate-limit/caddy-rate-limit"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
)

// adminPort is the in-process Caddy's admin endpoint. It is picked free at
// start so that test runs in two checkouts on one machine never collide.
var adminPort int

func TestMain(m *testing.M) {
	adminPort = freePort()
	caddytest.Default.AdminPort = adminPort
	os.Exit(m.Run())
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort() int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		panic(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// server is a running Caddy config under test.
type server struct {
	*caddytest.Tester
	t    *testing.T
	Port int    // the HTTP port of the site
	Base string // "http://127.0.0.1:<Port>"
}

// globals is prepended to every test Caddyfile: the admin endpoint must stay
// where caddytest expects it, and nothing may ask for certificates.
const globals = `{
	admin localhost:%d
	skip_install_trust
	auto_https off
	http_port %d
	https_port %d
	grace_period 1s
	%s
}
`

// startCaddy loads a Caddyfile into the in-process Caddy. site is the config
// after the global options; "$PORT" in it stands for a free port, and extra
// is added to the global options block. Call it again with the same server to
// reload.
func startCaddy(t *testing.T, extra, site string) *server {
	t.Helper()
	port := freePort()
	s := &server{Tester: caddytest.NewTester(t), t: t, Port: port, Base: fmt.Sprintf("http://127.0.0.1:%d", port)}
	s.reload(extra, site)
	return s
}

// reload loads a new Caddyfile on the same port, as a config reload through
// the admin API would.
func (s *server) reload(extra, site string) {
	s.t.Helper()
	cfg := fmt.Sprintf(globals, adminPort, s.Port, freePort(), extra) + strings.ReplaceAll(site, "$PORT", fmt.Sprint(s.Port))
	s.InitServer(cfg, "caddyfile")
	if s.t.Failed() {
		s.t.FailNow()
	}
}

// client is a plain HTTP client for requests the caddytest client would
// reroute (it sends every dial to 127.0.0.1).
var client = &http.Client{Timeout: 10 * time.Second}

// get sends a GET to path with the given headers (name, value pairs) and
// returns the response with its body read.
func (s *server) get(path string, headers ...string) (*http.Response, string) {
	s.t.Helper()
	return s.getHost("", path, headers...)
}

// getHost is get with the Host header set to host ("": the server's
// address).
func (s *server) getHost(host, path string, headers ...string) (*http.Response, string) {
	s.t.Helper()
	req, err := http.NewRequest(http.MethodGet, s.Base+path, nil)
	if err != nil {
		s.t.Fatal(err)
	}
	if host != "" {
		req.Host = host
	}
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		s.t.Fatalf("GET %s%s: %v", host, path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		s.t.Fatalf("reading GET %s%s: %v", host, path, err)
	}
	return resp, string(body)
}

// wantStatus fails the test unless resp has the given status.
func wantStatus(t *testing.T, resp *http.Response, want int) {
	t.Helper()
	if resp.StatusCode != want {
		t.Fatalf("status = %d, want %d", resp.StatusCode, want)
	}
}

// wantHeader fails the test unless resp carries header name with value want.
func wantHeader(t *testing.T, resp *http.Response, name, want string) {
	t.Helper()
	if got := resp.Header.Get(name); got != want {
		t.Errorf("%s = %q, want %q", name, got, want)
	}
}

// eventually polls cond every 10ms for up to 2s and reports whether it
// held: for what this process's Caddy does after the client has its
// answer. A window or a ban is waited for by moving the zone's clock
// (fakeClock), never by a fixed sleep.
func eventually(cond func() bool) bool { return pollFor(2*time.Second, cond) }

// eventuallyAcross is eventually for what happens across processes: in
// Redis (a window on Redis's clock, a sync round, a failover) or in
// another Caddy. The deadline is far above the wait on an idle machine,
// so a loaded one is slow, not wrong.
func eventuallyAcross(cond func() bool) bool { return pollFor(10*time.Second, cond) }

// pollFor polls cond every 10ms for up to d and reports whether it held.
func pollFor(d time.Duration, cond func() bool) bool {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return cond()
}

// waitWindowOver waits until the zone's listing counts nothing for key
// ("policy/key", as listingOf names it): its window, on Redis's clock, has
// ended. The key must be counted when it is called, so that a misnamed key
// cannot make the wait pass at once; it fails the test if the window still
// counts after eventuallyAcross's deadline.
func waitWindowOver(t *testing.T, zone, key string) {
	t.Helper()
	counted := func() string { return listingOf(t, zone)[key] }
	if l := counted(); l == "" || strings.HasPrefix(l, "0 ") {
		t.Fatalf("%s in zone %s is not counted (%q), so there is no window to wait out", key, zone, l)
	}
	over := func() bool { l := counted(); return l == "" || strings.HasPrefix(l, "0 ") }
	if !eventuallyAcross(over) {
		t.Fatalf("the window of %s in zone %s still counts %q 10s on", key, zone, counted())
	}
}

// fakeClock returns a fake clock, reading the time now, that the zones
// named zones read once Caddy creates them in this test: the test moves
// their time (Advance) instead of waiting for it. For memory zones: a
// Redis zone's windows follow Redis's clock.
func fakeClock(t *testing.T, zones ...string) *clock.Fake {
	t.Helper()
	c := clock.NewFake(time.Now())
	for _, z := range zones {
		t.Cleanup(clock.Use(z, c))
	}
	return c
}

// zoneRuns numbers the zones fresh names.
var zoneRuns atomic.Int64

// fresh returns name with a suffix that no other call returns: a zone
// outlives the configs that name it, so a test run again in this process
// (go test -count) needs new zones to start with no counts.
func fresh(name string) string {
	return fmt.Sprintf("%s-%d", name, zoneRuns.Add(1))
}

// statusOf sends a GET of base's / with the header name set to value and
// returns the status, or -1 when the request failed (an instance that was
// killed).
func statusOf(t *testing.T, base, name, value string) int {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, base+"/", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set(name, value)
	resp, err := loadClient.Do(req)
	if err != nil {
		return -1
	}
	resp.Body.Close()
	return resp.StatusCode
}

// within polls cond every 10ms until it holds and returns how long that
// took, failing the test with what once d has passed: for a bound the
// feature promises (an unblock or an override applied fleet-wide within
// a second).
func within(t *testing.T, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("%s: not within %s", what, d)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(start)
}
