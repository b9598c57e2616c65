package ratelimit

import (
	"context"
	"net/http"
	"sync"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyevents"
)

// eventLog is an events handler that records the events it is given.
type eventLog struct {
	mu     sync.Mutex
	events []caddy.Event
}

func (l *eventLog) Handle(_ context.Context, e caddy.Event) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, e)
	return nil
}

// startEventLog starts an events app in ctx whose log records the events
// named.
func startEventLog(t *testing.T, ctx caddy.Context, names ...string) (*caddyevents.App, *eventLog) {
	t.Helper()
	app := new(caddyevents.App)
	if err := app.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	log := new(eventLog)
	for _, name := range names {
		if err := app.On(name, log); err != nil {
			t.Fatal(err)
		}
	}
	if err := app.Start(); err != nil {
		t.Fatal(err)
	}
	return app, log
}

func TestEventExceededOncePerWindow(t *testing.T) {
	t.Parallel()
	rl, ctx := provisionHandler(t, "events-once", 2, true)
	app, log := startEventLog(t, ctx, EventExceeded)
	rl.events = app

	statuses := []int{}
	for range 5 {
		statuses = append(statuses, serve(t, rl, "192.0.2.20"))
	}
	serve(t, rl, "192.0.2.21")
	if statuses[1] != http.StatusOK || statuses[2] != http.StatusTooManyRequests {
		t.Fatalf("statuses = %v, want two 200s then 429s", statuses)
	}
	if len(log.events) != 1 {
		t.Fatalf("got %d events, want 1 for three refusals of one key in one window", len(log.events))
	}
	e := log.events[0]
	if e.Name() != EventExceeded || e.Data["zone"] != "events-once" || e.Data["key"] != "192.0.2.20" || e.Data["max"] != 2 {
		t.Errorf("event %s %v, want %s for zone events-once key 192.0.2.20 max 2", e.Name(), e.Data, EventExceeded)
	}
}

// Without an events app in the config, the handler has none and refusing
// still works.
func TestEventsAppOptional(t *testing.T) {
	t.Parallel()
	rl, _ := provisionHandler(t, "events-none", 1, true)
	if rl.events != nil {
		t.Fatal("handler took an events app the config does not have")
	}
	serve(t, rl, "192.0.2.30")
	if got := serve(t, rl, "192.0.2.30"); got != http.StatusTooManyRequests {
		t.Errorf("status %d, want 429", got)
	}
}
