package limiter

import (
	"context"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// unblockChannel is the Redis channel on which the instances sharing the
// zone announce the keys an unblock forgot, so that each drops them from its
// in-process caches at once rather than when their windows would end.
func (s *RedisStore) unblockChannel() string { return s.prefix + "unblocked" }

// listen drops from the in-process caches every key another instance (or
// this one) announces as unblocked, until ctx is done. The client
// resubscribes after a lost connection by itself; announcements made while
// not subscribed are lost, so on every subscription, the first included,
// the refused cache is emptied: the next decision of each key goes to
// Redis, which is never stale.
func (s *RedisStore) listen(ctx context.Context) {
	ps := s.client.Subscribe(ctx, s.unblockChannel())
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
				s.logger.Warn("unblock channel: other instances' unblocks are not heard until it works again",
					zap.String("channel", s.unblockChannel()), zap.Error(err))
				failing = true
			}
			select { // the next Receive reconnects; do not spin while Redis is away
			case <-ctx.Done():
				return
			case <-time.After(s.probeEvery):
			}
			continue
		}
		failing = false
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" {
				// What was cached before this (re)subscription may have
				// been unblocked unheard. Its pending refusal tallies go
				// to Redis first.
				fctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
				_ = s.flushRefused(fctx, time.Now())
				cancel()
				s.refused.forgetFunc(func(string) bool { return true })
				if s.sync != nil {
					// Redis may have restarted: the counts of the
					// running windows go to it again.
					s.sync.resend.Store(true)
				}
			}
		case *redis.Message:
			name, tag, _ := strings.Cut(m.Payload, "\x00")
			s.dropCached(name, tag)
		}
	}
}

// dropCached drops the key whose tag (the key, or its hash) is tag from the
// named limit's refused cache and from the local fallback store.
func (s *RedisStore) dropCached(name, tag string) {
	s.forgetSync(name, []string{tag})
	if s.hashKey == nil {
		s.refused.forget(cacheKey(name, tag))
		for slot := range MaxChecks {
			if s.local.slotName(slot) == name {
				_, _ = s.local.ForgetCheck(context.Background(), Check{Slot: slot, Key: tag})
			}
		}
		return
	}
	s.refused.forgetFunc(func(k string) bool {
		n, key := splitCacheKey(k)
		return n == name && s.tag(key) == tag
	})
}

// forgetSync drops, in sync mode, the named limit's entries of the keys
// whose tags (keys, or their hashes) are tags, with the counts they had not
// sent.
func (s *RedisStore) forgetSync(name string, tags []string) {
	if s.sync == nil {
		return
	}
	s.sync.forget(func(e *syncEntry) bool {
		tag := e.tag // set once a round has sent the key
		if tag == "" {
			tag = s.tag(e.key)
		}
		return e.name == name && slices.ContainsFunc(tags, func(t string) bool { return t == e.key || t == tag })
	})
}

// markUsed records that the store is in use, which starts its
// subscription to the unblock channel (Run).
func (s *RedisStore) markUsed() { s.useOnce.Do(func() { close(s.used) }) }
