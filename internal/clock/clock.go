// Package clock is the time the rate limiter reads: the real clock in
// production, and a fake one that tests move by hand, so that a test waits
// for a window, a ban or a sync round by advancing the clock instead of
// sleeping.
//
// Each zone takes its clock from For, by the zone's name: the real clock
// unless a test has registered another (Use) for that name. Zones are
// process-wide, and each test names its own, so tests running in parallel
// never share a fake clock. Deadlines on the network (a decision's round
// trip, a socket's) stay on the real clock, and the scripts that run in
// Redis read Redis's.
package clock

import (
	"sync"
	"time"
)

// Clock tells the time and makes timers.
type Clock interface {
	// Now returns the current time.
	Now() time.Time
	// NewTimer returns a timer that fires once, d from now.
	NewTimer(d time.Duration) Timer
	// NewTicker returns a ticker that fires every d (d > 0).
	NewTicker(d time.Duration) Ticker
	// AfterFunc calls f in its own goroutine d from now, unless the
	// returned timer is stopped first.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a time.Timer of a Clock.
type Timer interface {
	// C is the channel the fire time is sent on (nil for AfterFunc).
	C() <-chan time.Time
	// Stop prevents the timer from firing; it reports whether it did.
	Stop() bool
	// Reset makes the timer fire d from now.
	Reset(d time.Duration)
}

// Ticker is a time.Ticker of a Clock.
type Ticker interface {
	// C is the channel the ticks are sent on.
	C() <-chan time.Time
	// Stop turns the ticker off.
	Stop()
}

// Real is the system's clock.
var Real Clock = real{}

type real struct{}

func (real) Now() time.Time                            { return time.Now() }
func (real) NewTimer(d time.Duration) Timer            { return realTimer{time.NewTimer(d)} }
func (real) NewTicker(d time.Duration) Ticker          { return realTicker{time.NewTicker(d)} }
func (real) AfterFunc(d time.Duration, f func()) Timer { return realTimer{time.AfterFunc(d, f)} }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time   { return t.t.C }
func (t realTimer) Stop() bool            { return t.t.Stop() }
func (t realTimer) Reset(d time.Duration) { t.t.Reset(d) }

type realTicker struct{ t *time.Ticker }

func (t realTicker) C() <-chan time.Time { return t.t.C }
func (t realTicker) Stop()               { t.t.Stop() }

// registry holds the clocks tests registered, by zone name.
var registry sync.Map // string → Clock

// For returns the clock of the zone named name: the one Use registered,
// else Real.
func For(name string) Clock {
	if c, ok := registry.Load(name); ok {
		return c.(Clock)
	}
	return Real
}

// Use makes c the clock of the zones named name created from now on, until
// the returned func is called. For tests.
func Use(name string, c Clock) (undo func()) {
	registry.Store(name, c)
	return func() { registry.Delete(name) }
}

// Fake is a Clock that moves only when told to (Advance, Set). Its timers
// and tickers fire, in time order, as it moves past them. Safe for
// concurrent use.
type Fake struct {
	mu      sync.Mutex
	now     time.Time
	waiters []*fakeTimer
}

// NewFake returns a Fake clock reading start.
func NewFake(start time.Time) *Fake { return &Fake{now: start} }

// Now implements Clock.
func (f *Fake) Now() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.now
}

// Advance moves the clock d forward, firing what falls due on the way.
func (f *Fake) Advance(d time.Duration) { f.Set(f.Now().Add(d)) }

// Set moves the clock to t (never back), firing what falls due on the way,
// each at its own time.
func (f *Fake) Set(t time.Time) {
	for {
		f.mu.Lock()
		var next *fakeTimer
		for _, w := range f.waiters {
			if !w.at.After(t) && (next == nil || w.at.Before(next.at)) {
				next = w
			}
		}
		if next == nil {
			if t.After(f.now) {
				f.now = t
			}
			f.mu.Unlock()
			return
		}
		if next.at.After(f.now) {
			f.now = next.at
		}
		f.fireLocked(next)
		f.mu.Unlock()
	}
}

// Pending returns how many timers and tickers are due within d from now:
// a test advances the clock once the code under test waits on it.
func (f *Fake) Pending(d time.Duration) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, w := range f.waiters {
		if !w.at.After(f.now.Add(d)) {
			n++
		}
	}
	return n
}

// fireLocked fires w at f.now: a ticker is set again, a timer goes. The
// caller holds f.mu.
func (f *Fake) fireLocked(w *fakeTimer) {
	if w.every > 0 {
		w.at = w.at.Add(w.every)
	} else {
		f.removeLocked(w)
	}
	if w.f != nil {
		go w.f()
		return
	}
	select {
	case w.c <- f.now:
	default: // like time's: a tick nobody took is dropped
	}
}

func (f *Fake) removeLocked(w *fakeTimer) bool {
	for i, x := range f.waiters {
		if x == w {
			f.waiters = append(f.waiters[:i], f.waiters[i+1:]...)
			return true
		}
	}
	return false
}

func (f *Fake) add(d, every time.Duration, fn func()) *fakeTimer {
	f.mu.Lock()
	defer f.mu.Unlock()
	w := &fakeTimer{f: fn, clock: f, at: f.now.Add(d), every: every}
	if fn == nil {
		w.c = make(chan time.Time, 1)
	}
	f.waiters = append(f.waiters, w)
	return w
}

// NewTimer implements Clock.
func (f *Fake) NewTimer(d time.Duration) Timer { return f.add(d, 0, nil) }

// NewTicker implements Clock.
func (f *Fake) NewTicker(d time.Duration) Ticker { return fakeTicker{f.add(d, d, nil)} }

// AfterFunc implements Clock.
func (f *Fake) AfterFunc(d time.Duration, fn func()) Timer { return f.add(d, 0, fn) }

// fakeTimer is a timer or (every > 0) a ticker of a Fake.
type fakeTimer struct {
	clock *Fake
	c     chan time.Time
	f     func()
	at    time.Time
	every time.Duration
}

func (t *fakeTimer) C() <-chan time.Time { return t.c }

// Stop implements Timer. As with time's timers, no fire time is received
// after it.
func (t *fakeTimer) Stop() bool {
	t.clock.mu.Lock()
	defer t.clock.mu.Unlock()
	t.drain()
	return t.clock.removeLocked(t)
}

// Reset implements Timer.
func (t *fakeTimer) Reset(d time.Duration) {
	f := t.clock
	f.mu.Lock()
	defer f.mu.Unlock()
	t.drain()
	f.removeLocked(t)
	t.at = f.now.Add(d)
	f.waiters = append(f.waiters, t)
}

// drain drops a fire time not yet received.
func (t *fakeTimer) drain() {
	select {
	case <-t.c:
	default:
	}
}

// fakeTicker is a ticker of a Fake.
type fakeTicker struct{ t *fakeTimer }

func (t fakeTicker) C() <-chan time.Time { return t.t.c }
func (t fakeTicker) Stop()               { t.t.Stop() }

// Interface guards
var (
	_ Clock  = (*Fake)(nil)
	_ Timer  = (*fakeTimer)(nil)
	_ Ticker = fakeTicker{}
)
