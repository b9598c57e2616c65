package ratelimit

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// The wait room of delay holds at most perKey requests of one key and cap
// in all, and gives places back.
func TestWaitRoomBounds(t *testing.T) {
	wr := &waitRoom{byKey: map[string]int{}, perKey: 2, cap: 3}
	got := []bool{wr.enter("a"), wr.enter("a"), wr.enter("a"), wr.enter("b"), wr.enter("c")}
	want := []bool{true, true, false, true, false}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("enter a, a, a, b, c = %v, want %v (2 per key, 3 in all)", got, want)
		}
	}
	wr.leave("a")
	if !wr.enter("c") || wr.total != 3 {
		t.Fatalf("after a left: c refused or %d waiting, want c in and 3 waiting", wr.total)
	}
	for _, k := range []string{"a", "b", "c"} {
		wr.leave(k)
	}
	if wr.total != 0 || len(wr.byKey) != 0 {
		t.Fatalf("after all left: %d waiting, %d keys held, want none", wr.total, len(wr.byKey))
	}
}

// count_status entries: codes, classes, ranges and all.
func TestStatusRanges(t *testing.T) {
	r, err := parseStatusRanges("count_status", []string{"401", "5xx", "420-429"})
	if err != nil {
		t.Fatal(err)
	}
	for status, want := range map[int]bool{401: true, 400: false, 500: true, 599: true, 425: true, 430: false, 200: false} {
		if counts(r, status) != want {
			t.Errorf("status %d counts = %t, want %t", status, !want, want)
		}
	}
	if r, err := parseStatusRanges("count_status", []string{"all"}); err != nil || r != nil || !counts(r, 200) {
		t.Errorf("all = %v, %v: want nil (every status counts)", r, err)
	}
}

// A violation pending on requests in flight stands when any of them
// settles counted, lapses when all give their units back, and stands at
// the end of its window when they are still in flight then; it bans once.
func TestInFlightViolation(t *testing.T) {
	t.Parallel()
	c := limiter.Check{Key: "203.0.113.8", Limit: limiter.Limit{Window: time.Minute, Max: 5, Ban: time.Minute}}
	clk := clock.NewFake(time.Now())
	later := clk.Now().Add(time.Hour)
	for _, tc := range []struct {
		name    string
		counted []bool // how each of the two requests in flight settles
		want    int
	}{
		{"both counted", []bool{true, true}, 1},
		{"one counted, then one given back", []bool{true, false}, 1},
		{"both given back", []bool{false, false}, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var bans atomic.Int64
			f := &inFlight{flights: map[string]*flight{}, ban: func(limiter.Check) { bans.Add(1) }, clock: clk}
			f.enter("", c.Key)
			f.enter("", c.Key)
			if n := f.enter("", c.Key); n != 3 {
				t.Fatalf("third request in flight: %d, want 3", n)
			}
			f.violate("", c, later)
			f.violate("", c, later)   // a second refusal: still one violation
			f.leave("", c.Key, false) // the refused request itself
			for _, counted := range tc.counted {
				f.leave("", c.Key, counted)
			}
			if got := bans.Load(); got != int64(tc.want) {
				t.Fatalf("%d bans, want %d", got, tc.want)
			}
			if len(f.flights) != 0 {
				t.Fatalf("%d flights left, want none", len(f.flights))
			}
		})
	}
	t.Run("window ends in flight", func(t *testing.T) {
		banned := make(chan limiter.Check, 2)
		f := &inFlight{flights: map[string]*flight{}, ban: func(c limiter.Check) { banned <- c }, clock: clk}
		f.enter("", c.Key)
		f.enter("", c.Key)
		f.violate("", c, clk.Now().Add(time.Minute))
		f.leave("", c.Key, false)
		clk.Advance(time.Minute) // the window ends with a request in flight
		select {
		case got := <-banned:
			if got.Key != c.Key {
				t.Fatalf("banned %q, want %q", got.Key, c.Key)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no ban at the end of the window with a request still in flight")
		}
		f.leave("", c.Key, true) // settles after: the violation already stood
		select {
		case <-banned:
			t.Fatal("banned twice")
		default:
		}
	})
}

// Handlers of one config naming one zone must agree on dry_run: a dry-run
// handler would otherwise share the counts (and bans) of a live one.
func TestDryRunZoneAgreement(t *testing.T) {
	t.Parallel()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	live := &RateLimit{Zone: "dry-run-agree", Max: 5}
	if err := live.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer live.Cleanup()
	dry := &RateLimit{Zone: "dry-run-agree", Max: 5, DryRun: true}
	err := dry.Provision(ctx)
	if err == nil {
		dry.Cleanup()
		t.Fatal("a dry-run handler and a live one named one zone in one config")
	}
	if !strings.Contains(err.Error(), "dry_run=false") || !strings.Contains(err.Error(), "dry_run=true") {
		t.Fatalf("error = %v, want one naming both dry_run settings", err)
	}
}
