package ratelimit

import (
	"cmp"
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// The zone list of the admin API, and finding the live zones.

// settings returns the limit and the enabled switch of the config that
// last named the zone.
func (z *zone) settings() (limiter.Limit, bool) {
	s := z.newest()
	return s.limits[0].limit, s.enabled
}

// info describes the zone for the zone list.
func (z *zone) info(ctx context.Context) ZoneInfo {
	lim, enabled := z.settings()
	algorithm := AlgorithmFixed
	switch {
	case lim.GCRA():
		algorithm = AlgorithmGCRA
	case lim.Sliding():
		algorithm = AlgorithmSliding
	}
	var policies []PolicyInfo
	for _, l := range z.limits() {
		pi := PolicyInfo{Name: l.name, Max: l.limit.Max, WindowSeconds: int64(l.limit.Window / time.Second),
			BanSeconds: int64(l.limit.Ban / time.Second), BanMaxSeconds: int64(l.limit.BanMax / time.Second)}
		if l.limit.GCRA() {
			pi.Burst = cmp.Or(l.limit.Burst, l.limit.Max)
		}
		policies = append(policies, pi)
	}
	zi := ZoneInfo{
		Name:                 z.name,
		Status:               "active",
		Enabled:              enabled,
		Store:                z.kind(),
		Algorithm:            algorithm,
		Policies:             policies,
		WindowSeconds:        int64(lim.Window / time.Second),
		Max:                  lim.Max,
		RejectedTotal:        z.results[resultLimited].Load(),
		WebSocketConnections: z.wsLive.Load(),
		Health:               z.health(),
		HashedKeys:           z.store.HashedKeys(),
		SpoofableKey:         z.spoofableKey(),
	}
	if st, ok := z.syncStats(time.Now()); ok {
		zi.Sync = &SyncInfo{
			Interval:      st.Interval.String(),
			Spend:         st.Spend,
			LagSeconds:    st.Lag.Seconds(),
			Instances:     st.Fleet,
			DroppedDeltas: st.Dropped,
		}
	}
	z.trackedKeys(ctx, &zi)
	if !zi.Enabled {
		zi.Status = "disabled"
	}
	return zi
}

// trackedKeysWait bounds how long the zone list waits for a count of a
// Redis zone's keys that is under way.
const trackedKeysWait = time.Second

// trackedKeys sets the zone's tracked keys in zi. A Redis store's Len counts
// only its local fallback store, so a Redis zone's keys are counted in Redis
// (CountKeys: a walk of the keyspace, paid for by the admin API only, never
// by requests or metrics, and shared by concurrent readers). While the store
// is degraded it is not asked: its fallback is what decides then.
func (z *zone) trackedKeys(ctx context.Context, zi *ZoneInfo) {
	fleet, ok := z.fleet()
	if !ok || fleet.Degraded() {
		zi.TrackedKeys = z.store.Len()
		return
	}
	ctx, cancel := context.WithTimeout(ctx, trackedKeysWait)
	defer cancel()
	c := fleet.CountKeys(ctx)
	zi.TrackedKeys, zi.TrackedKeysPartial = c.N, c.Partial
	zi.TrackedKeysAgeSeconds = int64(max(time.Since(c.At), 0) / time.Second)
}

// listZones describes every zone a loaded config names, sorted by name.
// The zones are described concurrently, so that the list waits for the
// counts of several Redis zones (trackedKeysWait each) at once, not in turn.
func listZones(ctx context.Context) []ZoneInfo {
	live := liveZones()
	out := make([]ZoneInfo, len(live))
	var wg sync.WaitGroup
	for i, z := range live {
		wg.Go(func() { out[i] = z.info(ctx) })
	}
	wg.Wait()
	slices.SortFunc(out, func(a, b ZoneInfo) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// liveZones returns every zone a loaded config names. It holds the pool's
// lock only to copy the pointers.
//
// A reload that moves a zone to another store holds the old zone and the new
// one under the same name for a moment; the newer one is listed.
func liveZones() []*zone {
	byName := map[string]*zone{}
	zones.Range(func(_, v any) bool {
		if z, ok := v.(*zone); ok {
			if old := byName[z.name]; old == nil || z.seq > old.seq {
				byName[z.name] = z
			}
		}
		return true
	})
	return slices.Collect(maps.Values(byName))
}

// findZone returns the zone called name, or nil if no loaded config names it.
func findZone(name string) *zone {
	var found *zone
	zones.Range(func(_, v any) bool {
		if z, ok := v.(*zone); ok && z.name == name && (found == nil || z.seq > found.seq) {
			found = z
		}
		return true
	})
	return found
}
