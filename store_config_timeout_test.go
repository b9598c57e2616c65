package ratelimit

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// A timeout above a second is the bound of a decision: the client the
// store config builds has no shorter read timeout that would cut it.
func TestRedisStoreTimeoutOverASecond(t *testing.T) {
	srv := redistest.Start(t)
	sc := &StoreConfig{Type: StoreRedis, Addresses: []string{srv.Addr}, Timeout: caddy.Duration(3 * time.Second)}
	if err := sc.provision(); err != nil {
		t.Fatal(err)
	}
	client := redis.NewUniversalClient(sc.opts)
	t.Cleanup(func() { client.Close() })
	s := limiter.NewRedisStore(limiter.RedisStoreOptions{Client: client, Prefix: "slow:", Timeout: time.Duration(sc.Timeout)})
	ctx := context.Background()
	lim := limiter.Limit{Window: time.Minute, Max: 10}
	if v, err := s.Hit(ctx, "k", time.Now(), lim); err != nil || v.StoreError {
		t.Fatalf("first hit: %+v, %v", v, err)
	}
	if !srv.Pause() {
		t.Skipf("%s cannot be paused", srv.Kind)
	}
	time.AfterFunc(1500*time.Millisecond, srv.Resume)
	start := time.Now()
	v, err := s.Hit(ctx, "k", time.Now(), lim)
	if err != nil || v.StoreError || !v.Allowed || v.Remaining != 8 {
		t.Fatalf("hit with redis 1.5s slow and a 3s timeout: %+v, %v after %s; want redis's verdict", v, err, time.Since(start))
	}
}
