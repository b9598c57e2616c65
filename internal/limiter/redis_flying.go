package limiter

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Requests in flight (Check.MaxInFlight) on the Redis stores: each slot is
// a lease in a sorted set per key and limit (the base's "f" key), renewed
// every third of its time to live while the request lives, and given back
// when it ends. The exact store takes it in the decision script's call;
// the sync store, which decides in memory, in a call of its own after an
// admitting decision (acquireFlying). A dead instance's leases lapse
// within the time to live: the scripts drop lapsed ones before they count.

// DefaultLeaseTTL is a lease's time to live when Settings gives none.
const DefaultLeaseTTL = 30 * time.Second

// flyingLeases are the leases this instance's requests in flight hold.
type flyingLeases struct {
	ttl    atomic.Int64 // time.Duration
	prefix string       // this instance's, before each lease's number
	seq    atomic.Uint64
	mu     sync.Mutex
	held   map[string]string // lease id → its sorted set's key
}

// leaseTTL returns the time to live of the store's leases.
func (s *redisCore) leaseTTL() time.Duration {
	if d := time.Duration(s.flying.ttl.Load()); d > 0 {
		return d
	}
	return DefaultLeaseTTL
}

// newLeaseID returns a lease id no other instance's or request's shares.
func (f *flyingLeases) newLeaseID() string {
	if f.prefix == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		f.prefix = hex.EncodeToString(b[:]) + ":"
	}
	return f.prefix + strconv.FormatUint(f.seq.Add(1), 36)
}

// takeLeases names a lease for each capped check before the decision.
func (s *redisCore) takeLeases(checks []Check) bool {
	capped := false
	for i := range checks {
		if c := &checks[i]; c.MaxInFlight > 0 {
			c.Lease, capped = s.flying.newLeaseID(), true
		}
	}
	return capped
}

// keepLeases records the leases of an admitted decision, which the renewal
// keeps alive until Release; for a decision that was not admitted (or
// not decided by Redis) it clears them, and gives back what Redis may hold
// of them when it may hold some (an error: the script may have run).
func (s *redisCore) keepLeases(checks []Check, out []Verdict, redisDecided bool) {
	admitted := redisDecided
	for i := range checks {
		admitted = admitted && out[i].Allowed
	}
	if admitted {
		s.flying.mu.Lock()
		if s.flying.held == nil {
			s.flying.held = map[string]string{}
		}
		for i := range checks {
			if c := &checks[i]; c.Lease != "" {
				s.flying.held[c.Lease] = s.base(c.Name, s.tag(c.Key)) + "f"
			}
		}
		s.flying.mu.Unlock()
		return
	}
	var lost []Check
	for i := range checks {
		if c := &checks[i]; c.Lease != "" {
			if !redisDecided {
				lost = append(lost, *c) // the script may have run with its reply lost
			}
			c.Lease = ""
		}
	}
	if len(lost) > 0 {
		go s.dropLeases(lost)
	}
}

// Release implements Store: each capped check's lease goes from the
// renewal at once and from Redis without the caller waiting; a check
// decided in-process (on_error local) gives back its local slot.
func (s *RedisStore) Release(_ context.Context, checks []Check) error {
	var leased []Check
	for i := range checks {
		c := &checks[i]
		switch {
		case c.MaxInFlight <= 0:
		case c.Lease == "":
			_ = s.local.Release(context.Background(), checks[i:i+1])
		default:
			leased = append(leased, *c)
		}
	}
	s.releaseLeases(leased)
	return nil
}

// dropLeases removes the checks' leases from Redis, in one round trip.
func (s *redisCore) dropLeases(checks []Check) {
	ctx, cancel := context.WithTimeout(context.Background(), s.slowTimeout())
	defer cancel()
	_, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range checks {
			c := &checks[i]
			p.ZRem(ctx, s.base(c.Name, s.tag(c.Key))+"f", c.Lease)
		}
		return nil
	})
	if err != nil {
		s.logger.Debug("giving back leases of requests in flight: they lapse by themselves", zap.Error(err))
	}
}

// renewLeases renews every lease of a request still in flight, every third
// of their time to live, until ctx is done.
func (s *redisCore) renewLeases(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.clock.NewTimer(s.leaseTTL() / 3).C():
		}
		s.flying.mu.Lock()
		held := make(map[string]string, len(s.flying.held))
		for id, key := range s.flying.held {
			held[id] = key
		}
		s.flying.mu.Unlock()
		if len(held) == 0 {
			continue
		}
		ttl := s.leaseTTL().Milliseconds()
		rctx, cancel := context.WithTimeout(ctx, s.slowTimeout())
		_, err := s.client.Pipelined(rctx, func(p redis.Pipeliner) error {
			for id, key := range held {
				leaseScript.Run(rctx, p, []string{key}, "renew", id, ttl, 0)
			}
			return nil
		})
		cancel()
		if err != nil {
			s.logger.Debug("renewing leases of requests in flight", zap.Error(err))
		}
	}
}

// localLease marks a sync store's slot taken in this process, while Redis
// failed and on_error is local.
const localLease = "local"

// acquireFlying takes, for a decision of the sync store that admitted the
// request, a lease of each capped check's key in Redis, in one round trip
// (redis_lease.lua). A key whose leases are all taken refuses the
// request: what the table counted goes back, and so do the leases taken.
// When Redis fails, on_error decides: allow admits without a slot, deny
// refuses with the error, local counts the slot in this process.
func (s *SyncStore) acquireFlying(ctx context.Context, checks []Check, now time.Time, out []Verdict) error {
	for i := range checks {
		if !out[i].Allowed {
			for j := range checks {
				checks[j].Lease = ""
			}
			return nil // refused: no slot to take
		}
	}
	ctx, cancel := context.WithTimeout(ctx, time.Duration(s.timeout.Load()))
	defer cancel()
	ttl := s.leaseTTL().Milliseconds()
	// The pipeline's function sees copies: handing it checks would move
	// every caller's checks to the heap, capped or not.
	leases := make([]Check, len(checks))
	copy(leases, checks)
	cmds := make([]*redis.Cmd, len(checks))
	_, err := s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range leases {
			if c := &leases[i]; c.Lease != "" {
				cmds[i] = leaseScript.Run(ctx, p, []string{s.base(c.Name, s.tag(c.Key)) + "f"}, "acquire", c.Lease, ttl, c.MaxInFlight)
			}
		}
		return nil
	})
	if err != nil {
		s.keepLeases(checks, nil, false) // the script may have run: they go
		return s.flyingFallback(checks, now, out, err)
	}
	full := -1
	for i, cmd := range cmds {
		if cmd != nil {
			if n, _ := cmd.Int(); n != 1 {
				full = i
			}
		}
	}
	if full < 0 {
		s.keepLeases(checks, out, true)
		return nil
	}
	_ = s.Refund(ctx, checks, now, out) // the table's counts go back
	var taken []Check
	for i := range checks {
		if c := &checks[i]; c.Lease != "" && i != full {
			taken = append(taken, *c)
		}
		checks[i].Lease = ""
	}
	if len(taken) > 0 {
		go s.dropLeases(taken)
	}
	out[full].Allowed, out[full].InFlightFull, out[full].RetryAfter = false, true, time.Second
	return nil
}

// flyingFallback decides the slots of an admitted sync decision when Redis
// failed to take their leases, as on_error says.
func (s *SyncStore) flyingFallback(checks []Check, now time.Time, out []Verdict, err error) error {
	switch s.OnError() {
	case OnErrorAllow:
		for i := range out[:len(checks)] {
			out[i].StoreError = true // admitted, without a slot
		}
		return nil
	case OnErrorDeny:
		_ = s.Refund(context.Background(), checks, now, out)
		return err
	}
	s.flyLocal.mu.Lock()
	defer s.flyLocal.mu.Unlock()
	if s.flyLocal.n == nil {
		s.flyLocal.n = map[string]int{}
	}
	for i := range checks {
		c := &checks[i]
		if c.MaxInFlight > 0 && s.flyLocal.n[cacheKey(c.Name, c.Key)] >= c.MaxInFlight {
			_ = s.Refund(context.Background(), checks, now, out)
			out[i].Allowed, out[i].InFlightFull, out[i].RetryAfter, out[i].StoreError = false, true, time.Second, true
			return nil
		}
	}
	for i := range checks {
		if c := &checks[i]; c.MaxInFlight > 0 {
			s.flyLocal.n[cacheKey(c.Name, c.Key)]++
			c.Lease = localLease
			out[i].StoreError = true
		}
	}
	return nil
}

// Release implements Store: a lease goes from the renewal at once and from
// Redis without the caller waiting; a slot taken in this process goes from
// its count.
func (s *SyncStore) Release(_ context.Context, checks []Check) error {
	var leased []Check
	for i := range checks {
		c := &checks[i]
		switch c.Lease {
		case "":
		case localLease:
			s.flyLocal.mu.Lock()
			if k := cacheKey(c.Name, c.Key); s.flyLocal.n[k] > 1 {
				s.flyLocal.n[k]--
			} else {
				delete(s.flyLocal.n, k)
			}
			s.flyLocal.mu.Unlock()
		default:
			leased = append(leased, *c)
		}
	}
	s.releaseLeases(leased)
	return nil
}

// releaseLeases forgets the leases and removes them from Redis without the
// caller waiting.
func (s *redisCore) releaseLeases(leased []Check) {
	if len(leased) == 0 {
		return
	}
	s.flying.mu.Lock()
	for i := range leased {
		delete(s.flying.held, leased[i].Lease)
	}
	s.flying.mu.Unlock()
	go s.dropLeases(leased)
}
