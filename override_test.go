package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
)

// putOverrideBody sends a PUT of body to the overrides of zone through the
// admin API's handler and returns the recorded response and its error.
func putOverrideBody(t *testing.T, zone, body string) (*httptest.ResponseRecorder, error) {
	t.Helper()
	w := httptest.NewRecorder()
	err := AdminAPI{}.Routes()[0].Handler.ServeHTTP(w, httptest.NewRequest(http.MethodPut, "/rate_limit/"+zone+"/overrides", strings.NewReader(body)))
	return w, err
}

// A zone keeps at most MaxOverrides: past it, a 409 that says so; an
// override of a key that has one replaces it, and a lapsed one makes
// room.
func TestOverrideBound(t *testing.T) {
	t.Parallel()
	clk := clock.NewFake(time.Now())
	t.Cleanup(clock.Use("overrides-bound", clk))
	rl, _ := provisionHandler(t, "overrides-bound", 5, true)
	z := rl.zone
	now := clk.Now()
	full := make(map[string]*Override, MaxOverrides)
	for i := range MaxOverrides - 1 {
		key := fmt.Sprintf("key:k%d", i)
		full[key] = &Override{Key: key, PlanConfig: PlanConfig{PlanLimit: PlanLimit{Max: 9}}, tag: key}
	}
	full["key:k0"].Expires = now.Add(time.Second).Unix()
	z.overrides.mu.Lock()
	z.publishOverrides(full)
	z.overrides.mu.Unlock()
	if _, err := putOverrideBody(t, z.name, `{"key": "192.0.2.1", "max": 7}`); err != nil {
		t.Fatalf("the %dth override: %v", MaxOverrides, err)
	}
	_, err := putOverrideBody(t, z.name, `{"key": "192.0.2.2", "max": 7}`)
	if !isAPIError(err, http.StatusConflict) || !strings.Contains(err.Error(), "keeps 10000 overrides, the most it may") {
		t.Fatalf("one more: %v, want a 409 naming the bound", err)
	}
	if _, err := putOverrideBody(t, z.name, `{"key": "192.0.2.1", "max": 8}`); err != nil {
		t.Fatalf("replacing an override in a full zone: %v", err)
	}
	if o := z.overrideOf("192.0.2.1", now); o == nil || o.Max != 8 {
		t.Fatalf("192.0.2.1's override = %+v, want max 8", o)
	}
	clk.Advance(2 * time.Second) // key:k0's lapsed
	if _, err := putOverrideBody(t, z.name, `{"key": "192.0.2.2", "max": 7}`); err != nil {
		t.Fatalf("an override once one lapsed: %v", err)
	}
	if n := len(z.overrides.table.Load().byTag); n != MaxOverrides {
		t.Errorf("%d overrides kept, want %d", n, MaxOverrides)
	}
}

// Setting and removing an override through the admin API logs the change
// and emits its event, with the override's values.
func TestOverrideEvents(t *testing.T) {
	t.Parallel()
	rl, ctx := provisionHandler(t, "overrides-events", 5, true, func(rl *RateLimit) {
		rl.Limits = []PolicyConfig{{Name: "hourly", Max: 50, Window: 3600_000_000_000}}
	})
	app, events := startEventLog(t, ctx, EventOverrideSet, EventOverrideRemoved)
	core, logs := observer.New(zap.InfoLevel)
	z := rl.zone
	z.mu.Lock()
	z.holders[len(z.holders)-1].settings.notify = overrideNotifier(ctx, app, zap.New(core), z.name)
	z.mu.Unlock()

	if _, err := putOverrideBody(t, z.name, `{"key": "key:acme", "max": 9, "limits": {"hourly": {"max": 90}}, "ttl": "1h"}`); err != nil {
		t.Fatal(err)
	}
	w := httptest.NewRecorder()
	if err := (AdminAPI{}).Routes()[0].Handler.ServeHTTP(w, httptest.NewRequest(http.MethodDelete, "/rate_limit/overrides-events/overrides?key=key:acme", nil)); err != nil {
		t.Fatal(err)
	}
	if len(events.events) != 2 {
		t.Fatalf("%d events, want 2", len(events.events))
	}
	set, removed := events.events[0], events.events[1]
	if set.Name() != EventOverrideSet || set.Data["zone"] != z.name || set.Data["key"] != "key:acme" || set.Data["max"] != 9 ||
		fmt.Sprint(set.Data["limits"]) != "map[hourly:{90 0 false 0}]" || set.Data["expires"] == int64(0) {
		t.Errorf("set event %s %v", set.Name(), set.Data)
	}
	if removed.Name() != EventOverrideRemoved || removed.Data["key"] != "key:acme" {
		t.Errorf("removed event %s %v", removed.Name(), removed.Data)
	}
	if n := logs.FilterMessage(EventOverrideSet).FilterField(zap.String("key", "key:acme")).Len(); n != 1 {
		t.Errorf("%d log lines of the set override, want 1: %v", n, logs.All())
	}
	if n := logs.FilterMessage(EventOverrideRemoved).FilterField(zap.String("zone", z.name)).Len(); n != 1 {
		t.Errorf("%d log lines of the removed override, want 1: %v", n, logs.All())
	}
}

// An override is set only for a key some request could be counted under,
// in the form the listing shows.
func TestCheckOverrideKey(t *testing.T) {
	t.Parallel()
	for key, ok := range map[string]bool{
		"192.0.2.7":     true,
		"2001:db8::/64": true,
		"2001:db8::1":   true,
		"key:acme":      true,
		"key:a b/../c":  true,
		"key:sha256:0123456789abcdef0123456789abcdef": true,
		"missing:anonymous":                           true,
		"":                                            false,
		"acme":                                        false,
		"key:":                                        false,
		"key:a\x00b":                                  false,
		"key:\u202eevil":                              false,
		"key:sha256:0123":                             false,
		"key:sha256:0123456789ABCDEF0123456789ABCDEF": false,
		"missing:ip":       false,
		"missing:{x}":      false,
		"192.0.2.07":       false,
		"::ffff:192.0.2.7": false,
		"2001:db8::1/64":   false,
		"fe80::1%eth0":     false,
		"192.0.2.0/24":     false,
	} {
		if err := checkOverrideKey(key); (err == nil) != ok {
			t.Errorf("checkOverrideKey(%q) = %v, want ok %t", key, err, ok)
		}
	}
}

// isAPIError reports whether err is an admin API error of status.
func isAPIError(err error, status int) bool {
	var aerr caddy.APIError
	return errors.As(err, &aerr) && aerr.HTTPStatus == status
}
