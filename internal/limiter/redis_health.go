package limiter

import (
	"context"
	"time"

	"go.uber.org/zap"
)

// Health states of a RedisStore, as Health returns them.
const (
	HealthHealthy    = "HEALTHY"    // Redis answers; every decision goes to it
	HealthDegraded   = "DEGRADED"   // Redis failed repeatedly; decisions apply on_error without waiting on it
	HealthRecovering = "RECOVERING" // Redis answers again; decisions go to it until it has proved itself
)

const (
	stateHealthy = iota
	stateDegraded
	stateRecovering
)

var stateNames = [...]string{HealthHealthy, HealthDegraded, HealthRecovering}

// Tuning of the health state machine.
const (
	// degradeAfter consecutive failed decisions make a healthy store
	// degraded.
	degradeAfter = 3
	// recoverAfter consecutive successes (probes or decisions) make a
	// recovering store healthy.
	recoverAfter = 3
	// defaultProbeEvery is how often a degraded store probes Redis.
	defaultProbeEvery = 500 * time.Millisecond
	// probeTimeout is the least time a probe waits for its answer.
	probeTimeout = time.Second
	// refusedFlushEvery is how often the refusals answered from the
	// in-process cache are added to the refused tallies in Redis.
	refusedFlushEvery = time.Second
)

// Health returns HealthHealthy, HealthDegraded or HealthRecovering.
func (s *redisCore) Health() string { return stateNames[s.state.Load()] }

// Healthy reports whether the store is HEALTHY, for the store health metric.
func (s *redisCore) Healthy() bool { return s.state.Load() == stateHealthy }

// failed records a failed decision.
func (s *redisCore) failed(err error) {
	switch s.state.Load() {
	case stateHealthy:
		if s.streak.Add(1) >= degradeAfter {
			s.transition(stateHealthy, stateDegraded, err)
		}
	case stateRecovering:
		s.transition(stateRecovering, stateDegraded, err)
	}
}

// succeeded records a successful round trip.
func (s *redisCore) succeeded() {
	switch s.state.Load() {
	case stateHealthy:
		if s.streak.Load() != 0 {
			s.streak.Store(0)
		}
	case stateRecovering:
		if s.streak.Add(1) >= recoverAfter {
			s.transition(stateRecovering, stateHealthy, nil)
		}
	}
}

// transition moves the store from one health state to another, if it is
// still in from, and logs the change once.
func (s *redisCore) transition(from, to int32, cause error) {
	if !s.state.CompareAndSwap(from, to) {
		return
	}
	s.streak.Store(0)
	fields := []zap.Field{zap.String("from", stateNames[from]), zap.String("to", stateNames[to]), zap.String("prefix", s.prefix)}
	switch to {
	case stateDegraded:
		s.logger.Warn("redis store degraded: deciding without redis, as on_error says, until it answers again",
			append(fields, zap.String("on_error", *s.onError.Load()), zap.Error(cause))...)
		select {
		case s.wake <- struct{}{}:
		default:
		}
	case stateRecovering:
		s.logger.Info("redis store recovering: redis answers again", fields...)
		s.owner.recovered()
	case stateHealthy:
		s.logger.Info("redis store healthy", fields...)
	}
}

// run probes Redis whenever the store is degraded, until it is healthy
// again, runs the counts CountKeys asks for, listens to the unblock channel
// once the store is used, and calls flush (when not nil) every
// refusedFlushEvery while the store is not degraded; it returns when ctx is
// done.
func (s *redisCore) run(ctx context.Context, flush func(ctx context.Context)) {
	go func() {
		// Nothing connects before the store is used: a config that is
		// only validated never subscribes.
		select {
		case <-ctx.Done():
			return
		case <-s.used:
		}
		s.listen(ctx)
	}()
	var tick <-chan time.Time
	if flush != nil {
		t := s.clock.NewTicker(refusedFlushEvery)
		defer t.Stop()
		tick = t.C()
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
			s.probe(ctx)
		case <-s.counts.ask:
			// In its own goroutine: a count takes seconds on a large
			// zone, and the refusals are flushed meanwhile.
			go s.count(ctx)
		case <-tick:
			if s.state.Load() != stateDegraded {
				flush(ctx)
			}
		}
	}
}

// Degraded reports whether the store is DEGRADED: it does not wait on Redis.
func (s *redisCore) Degraded() bool { return s.state.Load() == stateDegraded }

// probe runs probeOnce every probeEvery until the store is healthy or ctx
// is done.
func (s *redisCore) probe(ctx context.Context) {
	timer := s.clock.NewTimer(s.probeEvery)
	defer timer.Stop()
	for s.state.Load() != stateHealthy {
		select {
		case <-ctx.Done():
			return
		case <-timer.C():
		}
		s.probeStep(ctx)
		if ctx.Err() != nil {
			return
		}
		timer.Reset(s.probeEvery)
	}
}

// probeStep probes Redis once and records the outcome: a degraded store
// that Redis answers is recovering.
func (s *redisCore) probeStep(ctx context.Context) {
	// A probe keeps no request waiting, so it may take longer than a
	// decision: after a restart it must dial (and maybe handshake TLS
	// and authenticate) before its script runs.
	pctx, cancel := context.WithTimeout(ctx, max(time.Duration(s.timeout.Load()), probeTimeout))
	err := s.owner.probeOnce(pctx)
	cancel()
	switch {
	case ctx.Err() != nil:
	case err != nil:
		s.failed(err)
	case s.state.Load() == stateDegraded:
		s.transition(stateDegraded, stateRecovering, nil)
		s.succeeded()
	default:
		s.succeeded()
	}
}

// probeTag names the key the probe decides on. No client key has this form
// (client keys are addresses or start with "key:"; hashed ones are hex), and
// Range skips it.
const probeTag = "__probe"
