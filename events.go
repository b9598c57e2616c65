package ratelimit

import (
	"errors"
	"fmt"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// EventExceeded is the event emitted through Caddy's events app when a key
// first goes over its limit in a window (once per key per window, not once
// per refused request). Its data: zone, key, max, window (seconds) and reset
// (Unix seconds).
const EventExceeded = "rate_limit_exceeded"

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

// emitExceeded emits EventExceeded for key if anything listens for it.
func (rl *RateLimit) emitExceeded(key string, v Verdict) {
	if rl.events == nil || !rl.events.ShouldEmit(EventExceeded) {
		return
	}
	rl.events.Emit(rl.ctx, EventExceeded, map[string]any{
		"zone":   rl.Zone,
		"key":    key,
		"max":    v.Limit,
		"window": int64(rl.limit.Window / time.Second),
		"reset":  ceilSeconds(v.Reset.UnixNano()),
	})
}
