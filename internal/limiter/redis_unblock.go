package limiter

import (
	"context"
	"strings"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// unblockChannel is the Redis channel on which the instances sharing the
// zone announce the keys an unblock forgot, so that each drops them from its
// in-process caches at once rather than when their windows would end.
func (s *redisCore) unblockChannel() string { return s.prefix + "unblocked" }

// listen drops from the in-process state every key another instance (or
// this one) announces as unblocked (owner.dropCached), and tells the zone
// of every change to its overrides, until ctx is done. The client
// resubscribes after a lost connection by itself; announcements made while
// not subscribed are lost, so the owner hears of every subscription, the
// first included (owner.subscribed), and the zone reads its overrides
// again.
func (s *redisCore) listen(ctx context.Context) {
	ps := s.client.Subscribe(ctx, s.unblockChannel(), s.overridesChannel())
	// Receive does not return when ctx ends: closing the subscription
	// makes it.
	stop := context.AfterFunc(ctx, func() { _ = ps.Close() })
	defer stop()
	defer ps.Close()
	failing := false
	for {
		msg, err := ps.Receive(ctx)
		if ctx.Err() != nil {
			return
		}
		if err != nil {
			if !failing {
				// Once per outage: a NOPERM (a Redis user without
				// channel rights) would otherwise fail silently.
				s.logger.Warn("unblock channel: other instances' unblocks and overrides are not heard until it works again",
					zap.String("channel", s.unblockChannel()), zap.Error(err))
				failing = true
			}
			select { // the next Receive reconnects; do not spin while Redis is away
			case <-ctx.Done():
				return
			case <-s.clock.NewTimer(s.probeEvery).C():
			}
			continue
		}
		failing = false
		switch m := msg.(type) {
		case *redis.Subscription:
			switch {
			case m.Kind != "subscribe":
			case m.Channel == s.overridesChannel():
				s.overridesChanged()
			default:
				s.owner.subscribed(ctx)
			}
		case *redis.Message:
			if m.Channel == s.overridesChannel() {
				s.overridesChanged()
				continue
			}
			name, tag, _ := strings.Cut(m.Payload, "\x00")
			s.owner.dropCached(name, tag)
		}
	}
}

// markUsed records that the store is in use, which starts its
// subscription to the unblock channel (Run).
func (s *redisCore) markUsed() { s.useOnce.Do(func() { close(s.used) }) }
