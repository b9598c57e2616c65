package limiter

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"time"

	"github.com/redis/go-redis/v9"
)

// leaseScript takes, renews and gives back WebSocket leases: see
// redis_lease.lua.
//
//go:embed redis_lease.lua
var leaseSource string

var leaseScript = redis.NewScript(leaseSource)

// Lease is one open WebSocket's hold on its key's share of a socket cap
// that every instance sharing the Redis counts together. Its zero value holds
// nothing.
type Lease struct {
	key, id string
}

// AcquireLease takes one of key's at most maxOpen leases for ttl, unless
// key holds maxOpen unexpired leases already (ok false). Keep it with
// RenewLease more often than ttl and give it back with ReleaseLease; the
// lease of an instance that dies lapses after ttl. An error means Redis did
// not answer (the caller falls back as on_error says).
func (s *redisCore) AcquireLease(ctx context.Context, key string, maxOpen int, ttl time.Duration) (Lease, bool, error) {
	s.awaitWarm(ctx)
	ctx, cancel := context.WithTimeout(ctx, time.Duration(s.timeout.Load()))
	defer cancel()
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return Lease{}, false, err
	}
	l := Lease{key: s.base("", s.tag(key)) + "ws", id: hex.EncodeToString(b[:])}
	n, err := leaseScript.Run(ctx, s.client, []string{l.key}, "acquire", l.id, ttl.Milliseconds(), maxOpen).Int()
	if err != nil {
		// The script may have run with its reply lost: give the lease
		// back rather than let it hold a place until it lapses.
		go func() { _ = s.ReleaseLease(context.Background(), l) }()
		return Lease{}, false, err
	}
	return l, n == 1, nil
}

// RenewLease extends l by ttl from now. A lease Redis lost (a failover, a
// restart) is taken again, over the cap if need be, since its socket still
// lives; lost reports that.
func (s *redisCore) RenewLease(ctx context.Context, l Lease, ttl time.Duration) (lost bool, err error) {
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	n, err := leaseScript.Run(ctx, s.client, []string{l.key}, "renew", l.id, ttl.Milliseconds(), 0).Int()
	return n == 2, err
}

// ReleaseLease gives l back.
func (s *redisCore) ReleaseLease(ctx context.Context, l Lease) error {
	ctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
	defer cancel()
	return leaseScript.Run(ctx, s.client, []string{l.key}, "release", l.id, 0, 0).Err()
}
