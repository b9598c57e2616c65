package tests

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// scrape reads Caddy's /metrics from the admin endpoint and returns the
// rate limit series of zone, keyed by the series as written without the
// value ("caddy_rate_limit_requests_total{result=\"allowed\",zone=\"z\"}").
// It fails the test if a series appears twice.
func scrape(t *testing.T, zone string) map[string]float64 {
	t.Helper()
	status, body := admin(t, http.MethodGet, "/metrics")
	if status != http.StatusOK {
		t.Fatalf("GET /metrics: status %d: %s", status, body)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(strings.NewReader(body))
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "caddy_rate_limit_") || !strings.Contains(line, `zone="`+zone+`"`) {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		if _, dup := out[line[:i]]; dup {
			t.Errorf("series %s appears twice", line[:i])
		}
		out[line[:i]] = v
	}
	return out
}

// series names one rate limit series of zone, with a result label if result
// is not empty.
func series(name, zone, result string) string {
	if result != "" {
		return fmt.Sprintf("caddy_rate_limit_%s{result=%q,zone=%q}", name, result, zone)
	}
	return fmt.Sprintf("caddy_rate_limit_%s{zone=%q}", name, zone)
}

// refusalSeries names the refusals counter of one limit of a zone.
func refusalSeries(zone, limit string) string {
	return fmt.Sprintf("caddy_rate_limit_refusals_total{limit=%q,zone=%q}", limit, zone)
}

// The counters on Caddy's /metrics survive a config reload: the reloaded
// config reports the counts from before it, adds to them, and no series is
// registered twice.
func TestMetricsAcrossReload(t *testing.T) {
	const site = `
:$PORT {
	rate_limit {
		zone e2e-metrics
		window 60
		max %d
	}
	respond "ok"
}`
	s := startCaddy(t, trustLoopback, fmt.Sprintf(site, 2))
	for _, ip := range []string{"192.0.2.1", "192.0.2.1", "192.0.2.1", "192.0.2.2"} {
		s.get("/", "X-Forwarded-For", ip)
	}
	want := map[string]float64{
		series("requests_total", "e2e-metrics", "allowed"):          3,
		series("requests_total", "e2e-metrics", "limited"):          1,
		series("requests_total", "e2e-metrics", "dry_run"):          0,
		series("requests_total", "e2e-metrics", "invalid"):          0,
		series("requests_total", "e2e-metrics", "degraded_allowed"): 0,
		series("requests_total", "e2e-metrics", "degraded_denied"):  0,
		series("requests_total", "e2e-metrics", "delayed"):          0,
		series("requests_total", "e2e-metrics", "in_flight"):        0,
		refusalSeries("e2e-metrics", "e2e-metrics"):                 1,
		series("tracked_keys", "e2e-metrics", ""):                   2,
		series("evictions_total", "e2e-metrics", ""):                0,
		series("dry_run_bans_total", "e2e-metrics", ""):             0,
		series("charged_units_total", "e2e-metrics", ""):            0,
		series("invalid_charges_total", "e2e-metrics", "missing"):   0,
		series("invalid_charges_total", "e2e-metrics", "invalid"):   0,
		series("websocket_connections", "e2e-metrics", ""):          0,
		series("requests_in_flight", "e2e-metrics", ""):             0,
	}
	check := func(when string) {
		t.Helper()
		got := scrape(t, "e2e-metrics")
		for k, v := range want {
			if g, ok := got[k]; !ok || g != v {
				t.Errorf("%s: %s = %v (present %t), want %v", when, k, g, ok, v)
			}
		}
		if len(got) != len(want) {
			t.Errorf("%s: series %v, want exactly %v", when, got, want)
		}
	}
	check("before reload")

	s.reload(trustLoopback, fmt.Sprintf(site, 3))
	check("after reload")

	resp, _ := s.get("/", "X-Forwarded-For", "192.0.2.1") // third admitted under max 3
	wantStatus(t, resp, http.StatusOK)
	resp, _ = s.get("/", "X-Forwarded-For", "192.0.2.1")
	wantStatus(t, resp, http.StatusTooManyRequests)
	want[series("requests_total", "e2e-metrics", "allowed")] = 4
	want[series("requests_total", "e2e-metrics", "limited")] = 2
	want[refusalSeries("e2e-metrics", "e2e-metrics")] = 2
	check("after reload and more traffic")
}

// recorded holds the events the test handler below was given.
var recorded struct {
	sync.Mutex
	events []caddy.Event
}

func init() {
	caddy.RegisterModule(eventRecorder{})
}

// eventRecorder is an events handler module, events.handlers.test_recorder,
// that records every event it handles, so a test can hook
// rate_limit_exceeded as a user's Caddyfile would.
type eventRecorder struct{}

func (eventRecorder) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "events.handlers.test_recorder", New: func() caddy.Module { return new(eventRecorder) }}
}

func (eventRecorder) Handle(_ context.Context, e caddy.Event) error {
	recorded.Lock()
	defer recorded.Unlock()
	recorded.events = append(recorded.events, e)
	return nil
}

func (*eventRecorder) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if d.NextArg() {
		return d.ArgErr()
	}
	return nil
}

var (
	_ caddyevents.Handler   = eventRecorder{}
	_ caddyfile.Unmarshaler = (*eventRecorder)(nil)
)

// A key going over its limit emits one rate_limit_exceeded event per window
// through the events app, with the zone and key.
func TestEventExceeded(t *testing.T) {
	recorded.Lock()
	recorded.events = nil // a run with -count above 1 starts afresh
	recorded.Unlock()
	s := startCaddy(t, trustLoopback+`
	events {
		on rate_limit_exceeded test_recorder
	}`, `
:$PORT {
	rate_limit {
		zone e2e-events
		window 60
		max 1
	}
	respond "ok"
}`)
	for _, ip := range []string{"192.0.2.40", "192.0.2.40", "192.0.2.40", "192.0.2.41"} {
		s.get("/", "X-Forwarded-For", ip)
	}
	recorded.Lock()
	defer recorded.Unlock()
	var mine []caddy.Event
	for _, e := range recorded.events {
		if e.Data["zone"] == "e2e-events" {
			mine = append(mine, e)
		}
	}
	if len(mine) != 1 {
		t.Fatalf("got %d rate_limit_exceeded events for the zone, want 1: %v", len(mine), mine)
	}
	e := mine[0]
	if e.Name() != "rate_limit_exceeded" || e.Data["key"] != "192.0.2.40" || e.Data["max"] != 1 {
		t.Errorf("event %s %v, want rate_limit_exceeded for key 192.0.2.40 max 1", e.Name(), e.Data)
	}
	if e.Origin() == nil || e.Origin().CaddyModule().ID != "http.handlers.rate_limit" {
		t.Errorf("event origin = %v, want http.handlers.rate_limit", e.Origin())
	}
	if reset, ok := e.Data["reset"].(int64); !ok || reset < time.Now().Unix() {
		t.Errorf("event reset = %v, want a future Unix time", e.Data["reset"])
	}
}
