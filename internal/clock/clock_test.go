package clock

import (
	"sync/atomic"
	"testing"
	"time"
)

var t0 = time.Unix(1_800_000_000, 0)

// fired returns the time c holds, or the zero time when it holds none.
func fired(c <-chan time.Time) time.Time {
	select {
	case t := <-c:
		return t
	default:
		return time.Time{}
	}
}

// Timers fire at their own time as the clock moves past them, in order;
// a stopped one never does; Reset moves one; a tick nobody took is
// dropped, as time's are.
func TestFakeTimers(t *testing.T) {
	f := NewFake(t0)
	late, soon, stopped := f.NewTimer(2*time.Second), f.NewTimer(time.Second), f.NewTimer(time.Second)
	if !stopped.Stop() || stopped.Stop() {
		t.Fatal("Stop of a waiting timer must report true once")
	}
	tick := f.NewTicker(500 * time.Millisecond)
	if n := f.Pending(time.Second); n != 2 {
		t.Fatalf("Pending(1s) = %d, want 2 (soon and the ticker)", n)
	}
	f.Advance(999 * time.Millisecond)
	if got := fired(soon.C()); !got.IsZero() {
		t.Fatalf("soon fired at %v, before its time", got)
	}
	if got := fired(tick.C()); !got.Equal(t0.Add(500 * time.Millisecond)) {
		t.Fatalf("tick at %v, want t0+500ms", got)
	}
	f.Advance(time.Millisecond)
	if got := fired(soon.C()); !got.Equal(t0.Add(time.Second)) {
		t.Fatalf("soon fired at %v, want t0+1s", got)
	}
	if got := fired(stopped.C()); !got.IsZero() {
		t.Fatal("a stopped timer fired")
	}
	late.Reset(3 * time.Second) // from t0+1s: fires at t0+4s
	f.Advance(2 * time.Second)
	if got := fired(late.C()); !got.IsZero() {
		t.Fatalf("a reset timer fired at %v, at its old time", got)
	}
	f.Advance(time.Second)
	if got := fired(late.C()); !got.Equal(t0.Add(4 * time.Second)) {
		t.Fatalf("late fired at %v, want t0+4s", got)
	}
	// Six ticks were due since the last one was taken: one is kept.
	if got := fired(tick.C()); got.IsZero() {
		t.Fatal("no tick kept")
	}
	if got := fired(tick.C()); !got.IsZero() {
		t.Fatal("more than one tick kept")
	}
	tick.Stop()
	f.Advance(time.Second)
	if got := fired(tick.C()); !got.IsZero() {
		t.Fatal("a stopped ticker ticked")
	}
	if !f.Now().Equal(t0.Add(5 * time.Second)) {
		t.Fatalf("Now = %v, want t0+5s", f.Now())
	}
}

// AfterFunc runs its func once its time comes, unless stopped.
func TestFakeAfterFunc(t *testing.T) {
	f := NewFake(t0)
	var ran atomic.Int32
	done := make(chan struct{})
	f.AfterFunc(time.Minute, func() { ran.Add(1); close(done) })
	f.AfterFunc(time.Minute, func() { ran.Add(10) }).Stop()
	f.Advance(59 * time.Second)
	if ran.Load() != 0 {
		t.Fatal("ran before its time")
	}
	f.Advance(time.Second)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("AfterFunc's func never ran")
	}
	if ran.Load() != 1 {
		t.Fatalf("ran = %d, want only the func not stopped", ran.Load())
	}
}

// For gives a zone's name the clock Use registered for it, until undone;
// the real clock otherwise.
func TestFor(t *testing.T) {
	f := NewFake(t0)
	undo := Use("zone-a", f)
	if For("zone-a") != Clock(f) || For("zone-b") != Real {
		t.Fatal("For does not return the registered clock, or Real for another name")
	}
	undo()
	if For("zone-a") != Real {
		t.Fatal("For still returns the fake after undo")
	}
}
