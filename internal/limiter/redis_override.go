package limiter

import (
	"context"
	_ "embed"
	"fmt"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Overrides in Redis: one hash per zone, a field per client tag (the key,
// or its HMAC with HashKey, so Redis holds no client key the zone hashes),
// whose value the zone writes and reads (the limiter does not parse it).
// A change is announced on the overrides channel; every instance reads the
// whole hash again when it hears one, and at each subscription, so an
// instance that was away when an override changed catches up when it is
// back.

// overrideScript sets an override within the zone's bound: see
// redis_override.lua.
//
//go:embed redis_override.lua
var overrideSource string

var overrideScript = redis.NewScript(overrideSource)

// overridesKey is the Redis hash of the zone's overrides.
func (s *redisCore) overridesKey() string { return s.prefix + "overrides" }

// overridesChannel is where instances announce a change to the overrides.
func (s *redisCore) overridesChannel() string { return s.prefix + "overrides-changed" }

// overrideWatch is the function WatchOverrides set, if any.
type overrideWatch = atomic.Pointer[func()]

// SetOverride implements Overrider.
func (s *redisCore) SetOverride(ctx context.Context, tag string, value []byte, most int) error {
	s.markUsed()
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	set, err := overrideScript.Run(ctx, s.client, []string{s.overridesKey()}, tag, value, most).Int()
	if err != nil {
		return err
	}
	if set == 0 {
		return fmt.Errorf("%w: the zone keeps %d already", ErrTooManyOverrides, most)
	}
	s.announceOverrides(ctx)
	return nil
}

// DeleteOverrides implements Overrider.
func (s *redisCore) DeleteOverrides(ctx context.Context, tags ...string) (int, error) {
	s.markUsed()
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	n, err := s.client.HDel(ctx, s.overridesKey(), tags...).Result()
	if err != nil {
		return 0, err
	}
	if n > 0 {
		s.announceOverrides(ctx)
	}
	return int(n), nil
}

// Overrides implements Overrider.
func (s *redisCore) Overrides(ctx context.Context) (map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	return s.client.HGetAll(ctx, s.overridesKey()).Result()
}

// WatchOverrides implements Overrider.
func (s *redisCore) WatchOverrides(fn func()) { s.watch.Store(&fn) }

// announceOverrides tells every instance, this one included, that the
// overrides changed. An instance that misses it reads them all again when
// it subscribes anew.
func (s *redisCore) announceOverrides(ctx context.Context) {
	if err := s.client.Publish(ctx, s.overridesChannel(), "").Err(); err != nil {
		s.logger.Warn("announcing an override change failed: other instances apply it when they next subscribe",
			zap.String("channel", s.overridesChannel()), zap.Error(err))
	}
	s.overridesChanged() // at once here, whatever the channel does
}

// overridesChanged calls the function WatchOverrides set.
func (s *redisCore) overridesChanged() {
	if fn := s.watch.Load(); fn != nil {
		(*fn)()
	}
}
