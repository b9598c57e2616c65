package ratelimit

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric descriptors. Their only labels are the zone, the limit name and the
// result, never a key or an IP, so the number of series stays bounded by the
// config.
var (
	requestsDesc = prometheus.NewDesc("caddy_rate_limit_requests_total",
		"Requests decided by the rate limiter, by zone and result (allowed, limited, dry_run, invalid, degraded_allowed, degraded_denied, delayed, in_flight).",
		[]string{"zone", "result"}, nil)
	refusalsDesc = prometheus.NewDesc("caddy_rate_limit_refusals_total",
		"Refusals by zone and limit: a request refused by several limits counts in each (dry-run refusals included).",
		[]string{"zone", "limit"}, nil)
	dryRunBansDesc = prometheus.NewDesc("caddy_rate_limit_dry_run_bans_total",
		"Bans that dry-run handlers would have started (a dry run writes none), by zone.",
		[]string{"zone"}, nil)
	trackedKeysDesc = prometheus.NewDesc("caddy_rate_limit_tracked_keys",
		"Keys the zone's store tracks now in this process (for a Redis zone, its local fallback store's; in sync mode, the keys it decides from).",
		[]string{"zone"}, nil)
	evictionsDesc = prometheus.NewDesc("caddy_rate_limit_evictions_total",
		"Live keys evicted because the zone tracked max_tracked keys or more: to make room for new ones, or to reach a lowered max_tracked.",
		[]string{"zone"}, nil)
	storeHealthyDesc = prometheus.NewDesc("caddy_rate_limit_store_healthy",
		"1 when the zone's shared store (Redis) is HEALTHY, 0 when DEGRADED or RECOVERING. Absent for in-process zones.",
		[]string{"zone"}, nil)
	syncRoundTripsDesc = prometheus.NewDesc("caddy_rate_limit_sync_round_trips_total",
		"Round trips to Redis of a zone in sync mode (each carries the counts of up to 2,000 keys).",
		[]string{"zone"}, nil)
	syncBatchesDesc = prometheus.NewDesc("caddy_rate_limit_sync_batches_total",
		"Script calls (batches) the sync round trips carried; sync_keys_total / sync_batches_total is the mean keys per batch.",
		[]string{"zone"}, nil)
	syncKeysDesc = prometheus.NewDesc("caddy_rate_limit_sync_keys_total",
		"Keys whose counts the sync batches sent.",
		[]string{"zone"}, nil)
	syncLagDesc = prometheus.NewDesc("caddy_rate_limit_sync_lag_seconds",
		"How old, at most, the fleet's counts this instance decides from are: the time since its last sync that reached Redis began.",
		[]string{"zone"}, nil)
	syncDroppedDesc = prometheus.NewDesc("caddy_rate_limit_sync_dropped_deltas_total",
		"Keys whose counts of a window never reached Redis: evicted while Redis was away (max_tracked), or sent after the window had ended in Redis.",
		[]string{"zone"}, nil)
	syncFleetDesc = prometheus.NewDesc("caddy_rate_limit_sync_instances",
		"Instances that synced the zone within the last three intervals, as the last sync read.",
		[]string{"zone"}, nil)
	websocketDesc = prometheus.NewDesc("caddy_rate_limit_websocket_connections",
		"WebSocket connections open through the zone now.",
		[]string{"zone"}, nil)
	chargedDesc = prometheus.NewDesc("caddy_rate_limit_charged_units_total",
		"Units spent by what responses reported (charge), by zone: the estimate where a response's charge was missing or invalid.",
		[]string{"zone"}, nil)
	chargeFaultsDesc = prometheus.NewDesc("caddy_rate_limit_invalid_charges_total",
		"Responses whose charge (charge) was missing or invalid, so that their estimate stood, by zone and result (missing, invalid).",
		[]string{"zone", "result"}, nil)
	inFlightDesc = prometheus.NewDesc("caddy_rate_limit_requests_in_flight",
		"Requests of the zone's limits with max_in_flight that are being served now.",
		[]string{"zone"}, nil)
)

// collector exports the counters of every live zone. It keeps no state of
// its own: the counts live in the zones, which outlive config reloads, so a
// reload neither resets a counter nor leaves a stale copy behind. Its zero
// value is ready to use and it is safe for concurrent use.
type collector struct{}

// registerMetrics adds the rate limiter's collector to a config's metrics
// registry. Every handler of a config calls it; the first registers and the
// rest find it registered, which is not an error.
func registerMetrics(reg prometheus.Registerer) error {
	if reg == nil {
		return nil
	}
	err := reg.Register(collector{})
	if are := (prometheus.AlreadyRegisteredError{}); errors.As(err, &are) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("registering rate limit metrics: %w", err)
	}
	return nil
}

// Describe implements prometheus.Collector.
func (collector) Describe(ch chan<- *prometheus.Desc) {
	ch <- requestsDesc
	ch <- refusalsDesc
	ch <- dryRunBansDesc
	ch <- trackedKeysDesc
	ch <- evictionsDesc
	ch <- websocketDesc
	ch <- inFlightDesc
	ch <- chargedDesc
	ch <- chargeFaultsDesc
	ch <- storeHealthyDesc
	ch <- syncRoundTripsDesc
	ch <- syncBatchesDesc
	ch <- syncKeysDesc
	ch <- syncLagDesc
	ch <- syncDroppedDesc
	ch <- syncFleetDesc
}

// Collect implements prometheus.Collector: it reads each live zone's
// counters, taking no lock that requests take.
func (collector) Collect(ch chan<- prometheus.Metric) {
	for _, z := range liveZones() {
		for result, name := range resultNames {
			ch <- prometheus.MustNewConstMetric(requestsDesc, prometheus.CounterValue,
				float64(z.results[result].Load()), z.name, name)
		}
		z.refusals.Range(func(k, v any) bool {
			ch <- prometheus.MustNewConstMetric(refusalsDesc, prometheus.CounterValue,
				float64(v.(*atomic.Uint64).Load()), z.name, k.(string))
			return true
		})
		ch <- prometheus.MustNewConstMetric(dryRunBansDesc, prometheus.CounterValue, float64(z.dryRunBans.Load()), z.name)
		ch <- prometheus.MustNewConstMetric(trackedKeysDesc, prometheus.GaugeValue, float64(z.store.Len()), z.name)
		ch <- prometheus.MustNewConstMetric(evictionsDesc, prometheus.CounterValue, float64(z.store.Evictions()), z.name)
		ch <- prometheus.MustNewConstMetric(websocketDesc, prometheus.GaugeValue, float64(z.wsLive.Load()), z.name)
		ch <- prometheus.MustNewConstMetric(inFlightDesc, prometheus.GaugeValue, float64(z.flying.Load()), z.name)
		ch <- prometheus.MustNewConstMetric(chargedDesc, prometheus.CounterValue, float64(z.charged.Load()), z.name)
		for fault, reason := range chargeFaultNames {
			ch <- prometheus.MustNewConstMetric(chargeFaultsDesc, prometheus.CounterValue, float64(z.chargeFaults[fault].Load()), z.name, reason)
		}
		if f, ok := z.fleet(); ok {
			healthy := 0.0
			if f.Healthy() {
				healthy = 1
			}
			ch <- prometheus.MustNewConstMetric(storeHealthyDesc, prometheus.GaugeValue, healthy, z.name)
		}
		if st, ok := z.syncStats(z.clock.Now()); ok {
			counter := func(d *prometheus.Desc, v uint64) {
				ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), z.name)
			}
			counter(syncRoundTripsDesc, st.RoundTrips)
			counter(syncBatchesDesc, st.Batches)
			counter(syncKeysDesc, st.Keys)
			counter(syncDroppedDesc, st.Dropped)
			ch <- prometheus.MustNewConstMetric(syncLagDesc, prometheus.GaugeValue, st.Lag.Seconds(), z.name)
			ch <- prometheus.MustNewConstMetric(syncFleetDesc, prometheus.GaugeValue, float64(st.Fleet), z.name)
		}
	}
}

// Interface guards
var _ prometheus.Collector = collector{}
