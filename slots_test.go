package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// serveThrough sends one request from ip, whose {http.vars.plan} is plan,
// through rl to next and returns its status, or -1 when next panicked.
func serveThrough(t *testing.T, rl *RateLimit, ip, plan string, next caddyhttp.Handler) (status int) {
	t.Helper()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	vars := map[string]any{caddyhttp.ClientIPVarKey: ip, "plan": plan}
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
	caddyhttp.NewTestReplacer(r)
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.ServerCtxKey, &caddyhttp.Server{}))
	w := httptest.NewRecorder()
	defer func() {
		if recover() != nil {
			status = -1
		}
	}()
	if err := rl.ServeHTTP(w, r, next); err != nil {
		if herr, ok := err.(caddyhttp.HandlerError); ok {
			return herr.StatusCode
		}
		t.Error(err)
	}
	return w.Code
}

// A plan's max_in_flight caps its clients' requests being served at once;
// the handler's own values (no cap) do not; a slot comes back when the
// request ends, even when a handler after it panics.
func TestPlanMaxInFlight(t *testing.T) {
	t.Parallel()
	rl, _ := provisionHandler(t, "slots-plan", 100, true, func(rl *RateLimit) {
		rl.PlanBy = "{http.vars.plan}"
		rl.Plans = map[string]PlanConfig{"small": {PlanLimit: PlanLimit{MaxInFlight: 1}}}
	})
	serveAs := func(ip, plan string, next caddyhttp.Handler) int { return serveThrough(t, rl, ip, plan, next) }
	ok := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error { w.WriteHeader(http.StatusOK); return nil })
	entered, leave := make(chan struct{}), make(chan struct{})
	slow := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		close(entered)
		<-leave
		return nil
	})
	done := make(chan int)
	go func() { done <- serveAs("192.0.2.1", "small", slow) }()
	<-entered
	if got := serveAs("192.0.2.1", "small", ok); got != http.StatusTooManyRequests {
		t.Errorf("a second request of the small plan in flight: %d, want 429", got)
	}
	if got := serveAs("192.0.2.2", "", ok); got != http.StatusOK {
		t.Errorf("a request on the default plan: %d, want 200", got)
	}
	close(leave)
	<-done
	panics := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { panic("boom") })
	if got := serveAs("192.0.2.1", "small", panics); got != -1 {
		t.Fatalf("a panicking handler: %d, want the panic", got)
	}
	if got := serveAs("192.0.2.1", "small", ok); got != http.StatusOK {
		t.Errorf("once the others ended (one by a panic): %d, want 200", got)
	}
	if n := rl.zone.flying.Load(); n != 0 {
		t.Errorf("%d requests counted in flight, want 0", n)
	}
}

// A refusal for requests in flight emits its event, at most one a second
// per zone.
func TestInFlightEvent(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Now())
	t.Cleanup(clock.Use("slots-event", clk))
	rl, ctx := provisionHandler(t, "slots-event", 100, true, func(rl *RateLimit) { rl.MaxInFlight = 1 })
	app, log := startEventLog(t, ctx, EventInFlightExceeded)
	rl.events = app
	checks := []limiter.Check{{Key: "192.0.2.1", MaxInFlight: 1}}
	p := &rl.policies[0]
	rl.emitInFlight(p, &checks[0], clk.Now())
	rl.emitInFlight(p, &checks[0], clk.Now().Add(500*time.Millisecond))
	if len(log.events) != 1 {
		t.Fatalf("%d events within a second, want 1", len(log.events))
	}
	e := log.events[0]
	if e.Data["zone"] != "slots-event" || e.Data["key"] != "192.0.2.1" || e.Data["max_in_flight"] != 1 || e.Data["limit"] != "slots-event" {
		t.Errorf("event data %v", e.Data)
	}
	rl.emitInFlight(p, &checks[0], clk.Now().Add(1100*time.Millisecond))
	if len(log.events) != 2 {
		t.Errorf("%d events after a second, want 2", len(log.events))
	}
}

// Under delay, a request refused for requests in flight waits as a rate
// refusal does, a second, and is admitted when a slot is free by then.
func TestDelayedInFlight(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Now())
	t.Cleanup(clock.Use("slots-delay", clk))
	rl, _ := provisionHandler(t, "slots-delay", 100, true, func(rl *RateLimit) {
		rl.MaxInFlight, rl.Delay = 1, caddy.Duration(2*time.Second)
	})
	entered, leave := make(chan struct{}), make(chan struct{})
	slow := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error {
		close(entered)
		<-leave
		return nil
	})
	ok := caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error { w.WriteHeader(http.StatusOK); return nil })
	first, second := make(chan int), make(chan int)
	go func() { first <- serveThrough(t, rl, "192.0.2.1", "", slow) }()
	<-entered
	go func() { second <- serveThrough(t, rl, "192.0.2.1", "", ok) }()
	for deadline := time.Now().Add(5 * time.Second); clk.Pending(1100*time.Millisecond) == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the second request never waited")
		}
	}
	close(leave)
	if got := <-first; got != http.StatusOK {
		t.Fatalf("the first: %d", got)
	}
	clk.Advance(1100 * time.Millisecond)
	if got := <-second; got != http.StatusOK {
		t.Fatalf("the delayed second: %d, want 200 once the first ended", got)
	}
	if n := rl.zone.results[resultDelayed].Load(); n != 1 {
		t.Errorf("%d requests counted delayed, want 1", n)
	}
}
