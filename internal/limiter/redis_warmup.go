package limiter

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// StartupWait bounds a client's warm-up (Warmup), and so how long the
// decisions that arrive before it ends wait for it: longer than a decision's
// default timeout, which a cold client cannot meet.
const StartupWait = time.Second

// Warmup is a Redis client's first contact with Redis: a Cluster's topology
// and the command table its routing reads, a connection to each master (or
// to the server), and the store's scripts loaded there. A cold client does
// all of that within the first decision's timeout, or fails it: on a loaded
// machine the first decisions of a fresh zone then time out and are decided
// as on_error says, by each instance on its own.
//
// The warm-up starts at a store's first decision (or WebSocket lease), not
// when the store is built, since building it is part of loading a config,
// which "caddy validate" does too, without Redis. The decisions that arrive
// before it ends wait for it, up to StartupWait from its start, and then get
// their whole timeout. A warm-up that fails is not retried: the decisions and
// the health probe deal with Redis from then on.
//
// Its zero value is not usable; call NewWarmup. A Warmup is safe for
// concurrent use, and one is shared by every store using its client.
type Warmup struct {
	client redis.UniversalClient
	once   sync.Once
	done   chan struct{} // closed when the warm-up has ended, warm or not
	ended  atomic.Bool   // done is closed: what a decision checks
}

// NewWarmup returns the warm-up of client. It does not connect: a store's
// first decision starts it.
func NewWarmup(client redis.UniversalClient) *Warmup {
	return &Warmup{client: client, done: make(chan struct{})}
}

// start begins the warm-up in the background, once; it logs a failure to
// logger.
func (w *Warmup) start(logger *zap.Logger) {
	w.once.Do(func() {
		// Bounded by its own deadline, not by a zone's life: the client
		// is shared, and closing it ends the warm-up at once.
		ctx, cancel := context.WithTimeout(context.Background(), StartupWait)
		go func() {
			defer cancel()
			start := time.Now()
			if err := w.run(ctx); err != nil {
				logger.Warn("first contact with redis failed: decisions go to it all the same, each within its timeout",
					zap.Duration("after", time.Since(start)), zap.Error(err))
			} else {
				logger.Debug("redis client warm", zap.Duration("took", time.Since(start)))
			}
			w.ended.Store(true)
			close(w.done)
		}()
	})
}

// wait returns when the warm-up has ended or ctx is done.
func (w *Warmup) wait(ctx context.Context) {
	select {
	case <-w.done:
	case <-ctx.Done():
	}
}

// run warms the client. On a Cluster, ForEachMaster loads the topology and
// reaches every master, and a command through the client then fetches the
// command table it routes every command by.
func (w *Warmup) run(ctx context.Context) error {
	cc, ok := w.client.(*redis.ClusterClient)
	if !ok {
		return warmNode(ctx, w.client)
	}
	if err := cc.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error { return warmNode(ctx, c) }); err != nil {
		return err
	}
	return cc.Ping(ctx).Err()
}

// warmNode connects to one Redis server (or, through a Sentinel client, to
// the master) and loads every script the store runs there, in one round
// trip.
func warmNode(ctx context.Context, c redis.UniversalClient) error {
	pipe := c.Pipeline()
	pipe.Ping(ctx)
	for _, s := range []string{hitSource, fixedSource, releaseSource, leaseSource} {
		pipe.ScriptLoad(ctx, s)
	}
	_, err := pipe.Exec(ctx)
	return err
}

// awaitWarm starts the client's warm-up if it has not started, and waits
// until it has ended or ctx is done. Once it has ended, it costs a load.
func (s *redisCore) awaitWarm(ctx context.Context) {
	if s.warm.ended.Load() {
		return
	}
	s.warm.start(s.logger)
	s.warm.wait(ctx)
}
