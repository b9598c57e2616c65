package ratelimit

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// EventExceeded is the event emitted through Caddy's events app when a key
// first goes over its limit in a window (once per key per window, not once
// per refused request), in each limit that refuses it. Its data: zone, limit
// (the limit's name), key, max, window (seconds), reset (Unix seconds) and
// dry_run (true when the handler let the request through).
const EventExceeded = "rate_limit_exceeded"

// EventInFlightExceeded is the event emitted when a limit's max_in_flight
// refuses a request: at most one a second per zone (a flood of refusals
// is a flood of events otherwise), naming the refusal that emitted it. Its
// data: zone, limit, key and max_in_flight.
const EventInFlightExceeded = "rate_limit_in_flight_exceeded"

// eventsApp returns the events app if the config has one, or nil, so that a
// config without it pays nothing to emit.
func eventsApp(ctx caddy.Context) (*caddyevents.App, error) {
	app, err := ctx.AppIfConfigured("events")
	if errors.Is(err, caddy.ErrNotConfigured) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("getting events app: %w", err)
	}
	return app.(*caddyevents.App), nil
}

// emitExceeded emits EventExceeded for key going over limit p, if anything
// listens for it.
func (rl *RateLimit) emitExceeded(p *policy, key string, v limiter.Verdict) {
	if rl.events == nil || !rl.events.ShouldEmit(EventExceeded) {
		return
	}
	rl.events.Emit(rl.ctx, EventExceeded, map[string]any{
		"zone":    rl.Zone,
		"limit":   p.name,
		"key":     key,
		"max":     v.Max,
		"window":  int64(p.check.Limit.Window / time.Second),
		"reset":   ceilSeconds(v.Reset.UnixNano()),
		"dry_run": rl.DryRun,
	})
}

// overrideNotifier returns what logs an override's change in zone, and
// emits its event (EventOverrideSet, EventOverrideRemoved) through the
// events app of the config ctx, if it has one.
func overrideNotifier(ctx caddy.Context, events *caddyevents.App, logger *zap.Logger, zone string) func(string, map[string]any) {
	return func(event string, data map[string]any) {
		data["zone"] = zone
		fields := make([]zap.Field, 0, len(data))
		for _, k := range slices.Sorted(maps.Keys(data)) {
			fields = append(fields, zap.Any(k, data[k]))
		}
		logger.Info(event, fields...)
		if events != nil && events.ShouldEmit(event) {
			events.Emit(ctx, event, data)
		}
	}
}

// emitInFlight emits EventInFlightExceeded for c's key, refused at now by
// p's max_in_flight, unless the zone emitted one less than a second ago or
// nothing listens.
func (rl *RateLimit) emitInFlight(p *policy, c *limiter.Check, now time.Time) {
	if rl.events == nil || !rl.events.ShouldEmit(EventInFlightExceeded) {
		return
	}
	last := rl.zone.inFlightEvent.Load()
	if now.UnixNano()-last < int64(time.Second) || !rl.zone.inFlightEvent.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	rl.events.Emit(rl.ctx, EventInFlightExceeded, map[string]any{
		"zone":          rl.Zone,
		"limit":         p.name,
		"key":           c.Key,
		"max_in_flight": c.MaxInFlight,
	})
}
