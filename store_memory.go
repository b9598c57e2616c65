package ratelimit

import (
	"go.uber.org/zap"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// Store types.
const (
	StoreMemory = "memory" // the in-process store (the default)
	StoreRedis  = "redis"  // counters in Redis, shared by every Caddy instance using it
)

// newStore builds the store that keeps zone's counters, as sc selects it (a
// nil sc is the memory store): the store, its kind as the admin API names
// it, and what lets go of what it shares with other zones (nil for none).
// It is the one place that picks a concrete store. The store reads clk,
// the zone's clock.
func (sc *StoreConfig) newStore(zone string, maxTracked int, clk clock.Clock, logger *zap.Logger) (limiter.Store, string, func() error) {
	if sc.isRedis() {
		s, closeStore := sc.newRedisStore(zone, maxTracked, clk, logger)
		return s, StoreRedis, closeStore
	}
	return limiter.NewMemoryStoreClock(maxTracked, clk), StoreMemory, nil
}
