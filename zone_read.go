package ratelimit

import (
	"cmp"
	"context"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// What a zone tells its readers (the admin API, the console, the metrics):
// its policies and settings, and its description for the zone list.

// zonePolicy is one policy of a zone (a named rule: the handler's first,
// named after the zone, or a limit block) as the zone keeps it and the
// admin API shows it.
type zonePolicy struct {
	name      string // as shown: the zone's name for the first policy
	storeName string // as the store keys it: "" for the first policy
	slot      int
	limit     limiter.Limit // its quota: max per window, and how it counts
}

// limits returns the limits of the config that last named the zone, the
// first first.
func (z *zone) limits() []zonePolicy {
	return z.newest().limits
}

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
	if st, ok := z.syncStats(z.clock.Now()); ok {
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
	zi.TrackedKeysAgeSeconds = int64(max(z.clock.Now().Sub(c.At), 0) / time.Second)
}
