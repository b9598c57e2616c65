package ratelimit

import (
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// zoneSeries gathers reg and returns the value of every rate limit series of
// zoneName, as "name{result}" (or "name" for series without a result).
func zoneSeries(t *testing.T, reg prometheus.Gatherer, zoneName string) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gathering: %v", err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "caddy_rate_limit_") {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["zone"] != zoneName {
				continue
			}
			for name := range labels {
				if name != "zone" && name != "result" && name != "limit" {
					t.Errorf("%s has label %q: only zone, limit and result are allowed", mf.GetName(), name)
				}
			}
			name := mf.GetName()
			if r, ok := labels["result"]; ok {
				name += "{" + r + "}"
			}
			if l, ok := labels["limit"]; ok {
				name += "{" + l + "}"
			}
			switch {
			case m.GetCounter() != nil:
				out[name] = m.GetCounter().GetValue()
			case m.GetGauge() != nil:
				out[name] = m.GetGauge().GetValue()
			}
		}
	}
	return out
}

func TestMetricsCountDecisions(t *testing.T) {
	t.Parallel()
	rl, ctx := provisionHandler(t, "metrics-count", 2, true)
	for range 5 {
		serve(t, rl, "192.0.2.7")
	}
	serve(t, rl, "192.0.2.8")

	got := zoneSeries(t, ctx.GetMetricsRegistry(), "metrics-count")
	want := map[string]float64{
		"caddy_rate_limit_requests_total{allowed}":          3,
		"caddy_rate_limit_requests_total{limited}":          3,
		"caddy_rate_limit_requests_total{dry_run}":          0,
		"caddy_rate_limit_requests_total{invalid}":          0,
		"caddy_rate_limit_requests_total{degraded_allowed}": 0,
		"caddy_rate_limit_requests_total{degraded_denied}":  0,
		"caddy_rate_limit_requests_total{delayed}":          0,
		"caddy_rate_limit_requests_total{in_flight}":        0,
		"caddy_rate_limit_refusals_total{metrics-count}":    3,
		"caddy_rate_limit_dry_run_bans_total":               0,
		"caddy_rate_limit_charged_units_total":              0,
		"caddy_rate_limit_invalid_charges_total{missing}":   0,
		"caddy_rate_limit_invalid_charges_total{invalid}":   0,
		"caddy_rate_limit_tracked_keys":                     2,
		"caddy_rate_limit_evictions_total":                  0,
		"caddy_rate_limit_websocket_connections":            0,
		"caddy_rate_limit_requests_in_flight":               0,
	}
	for name, w := range want {
		if g, ok := got[name]; !ok || g != w {
			t.Errorf("%s = %v (present %t), want %v", name, g, ok, w)
		}
	}
	if len(got) != len(want) {
		t.Errorf("series = %v, want exactly %v", got, want)
	}
}

// Several handlers provision into one config's registry: the collector is
// registered once, and each zone is reported once.
func TestMetricsRegisterOncePerRegistry(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	for range 3 {
		if err := registerMetrics(reg); err != nil {
			t.Fatalf("registering again: %v", err)
		}
	}
	if err := registerMetrics(nil); err != nil {
		t.Errorf("nil registry: %v", err)
	}
	rl, _ := provisionHandler(t, "metrics-once", 10, true)
	serve(t, rl, "192.0.2.9")
	got := zoneSeries(t, reg, "metrics-once")
	if got["caddy_rate_limit_requests_total{allowed}"] != 1 || len(got) != 16 {
		t.Errorf("series = %v, want 16 with allowed 1", got)
	}
	problems, err := testutil.CollectAndLint(collector{})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("lint: %s: %s", p.Metric, p.Text)
	}
}

// A reload provisions new handlers into a new registry while the zone lives
// on: the new registry reports the counts from before the reload.
func TestMetricsSurviveReload(t *testing.T) {
	t.Parallel()
	old, _ := provisionHandler(t, "metrics-reload", 1, true)
	serve(t, old, "192.0.2.10")
	serve(t, old, "192.0.2.10")
	fresh, ctx := provisionHandler(t, "metrics-reload", 1, true)
	if fresh.zone != old.zone {
		t.Fatal("the reloaded handler did not take the same zone")
	}
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	serve(t, fresh, "192.0.2.10")
	got := zoneSeries(t, ctx.GetMetricsRegistry(), "metrics-reload")
	if got["caddy_rate_limit_requests_total{allowed}"] != 1 || got["caddy_rate_limit_requests_total{limited}"] != 2 {
		t.Errorf("after reload: %v, want allowed 1, limited 2", got)
	}
}

func TestMetricsEvictions(t *testing.T) {
	t.Parallel()
	rl, ctx := provisionHandler(t, "metrics-evict", 10, true)
	rl.zone.store.(*limiter.MemoryStore).SetMaxTracked(MinMaxTracked)
	for i := range 3 * MinMaxTracked {
		serve(t, rl, "10.1."+strconv.Itoa(i>>8)+"."+strconv.Itoa(i&255))
	}
	got := zoneSeries(t, ctx.GetMetricsRegistry(), "metrics-evict")
	if got["caddy_rate_limit_evictions_total"] < MinMaxTracked {
		t.Errorf("evictions = %v, want at least %d", got["caddy_rate_limit_evictions_total"], MinMaxTracked)
	}
	if got["caddy_rate_limit_tracked_keys"] > MinMaxTracked {
		t.Errorf("tracked = %v, want at most %d", got["caddy_rate_limit_tracked_keys"], MinMaxTracked)
	}
	if got["caddy_rate_limit_requests_total{allowed}"] != 3*MinMaxTracked {
		t.Errorf("allowed = %v, want %d", got["caddy_rate_limit_requests_total{allowed}"], 3*MinMaxTracked)
	}
}
