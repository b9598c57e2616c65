package limiter

import (
	"strconv"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// A round with more keys than one round trip carries sends them in trips
// of syncTrip, each collected as it goes: every key reaches Redis once, and
// a key touched while the round runs waits for the next round, so that no
// key is sent twice in one round.
func TestSyncRoundTrips(t *testing.T) {
	srv := redistest.Start(t)
	s := manualFleet(t, srv, 1, RedisStoreOptions{Clock: alignedClock(time.Minute)})[0]
	lim := Limit{Window: time.Minute, Max: 10}
	const keys = 2*syncTrip + syncTrip/2
	for i := range keys {
		admit(t, s, "k"+strconv.Itoa(i), lim, 1)
	}
	y := s.table
	trips := y.stats.roundTrips.Load()
	round(s)
	if got := y.stats.roundTrips.Load() - trips; got != 3 {
		t.Errorf("a round of %d keys took %d round trips, want 3", keys, got)
	}
	if got := y.stats.keys.Load(); got != keys {
		t.Errorf("the round sent %d keys, want %d", got, keys)
	}
	for _, i := range []int{0, syncTrip - 1, syncTrip, keys - 1} {
		if n := count(t, s, "k"+strconv.Itoa(i)); n != 1 {
			t.Errorf("Redis holds %d for k%d, want 1", n, i)
		}
	}

	// Between two trips of a round: a key of a shard the round has opened
	// but not finished, touched after it opened, is left for the next.
	for i := range keys {
		admit(t, s, "k"+strconv.Itoa(i), lim, 1)
	}
	cur := syncCursor{ms: s.clock.Now().UnixMilli()}
	buf := make([]syncItem, 0, syncTrip)
	sent := map[*syncEntry]bool{}
	take := func() {
		for _, it := range y.collect(s, &cur, buf) {
			if sent[it.e.e] {
				t.Fatalf("%s collected twice in one round", it.key)
			}
			sent[it.e.e] = true
		}
	}
	take()
	if !cur.open {
		t.Fatal("the first trip ended at a shard's end: the test needs one left open")
	}
	sh := &y.shards[cur.shard]
	sh.mu.Lock()
	sh.slab.each(func(e *syncEntry) bool {
		if sent[e] {
			sh.touch(e) // touched again after its trip
		}
		return true
	})
	sh.mu.Unlock()
	for !cur.done() {
		take()
	}
	if len(sent) != keys {
		t.Errorf("the round collected %d keys, want %d", len(sent), keys)
	}
	sh.mu.Lock()
	waiting := len(sh.dirty)
	sh.mu.Unlock()
	if waiting == 0 {
		t.Error("no key waits for the next round: those touched again were sent twice")
	}
	if got := len(y.collect(s, &syncCursor{ms: cur.ms}, buf)); got != waiting {
		t.Errorf("the next round collected %d keys, want the %d touched again", got, waiting)
	}
}
