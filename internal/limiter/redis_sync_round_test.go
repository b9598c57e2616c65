package limiter

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

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
	sent := map[syncPlace]bool{}
	take := func() {
		for _, it := range y.collect(s, &cur, buf) {
			if sent[it.at] {
				t.Fatalf("%s collected twice in one round", it.key)
			}
			sent[it.at] = true
		}
	}
	take()
	if !cur.open {
		t.Fatal("the first trip ended at a shard's end: the test needs one left open")
	}
	sh := &y.shards[cur.shard]
	sh.mu.Lock()
	sh.slab.each(func(e *syncEntry) bool {
		if sent[e.place()] {
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

// The sync script packs its replies with Redis's struct library, and byte
// by byte where Lua has none (miniredis, which the fleet simulator runs):
// both read back the same, a dropped window's -1, a ban and numbers past
// 32 bits included. Each of a key's flags changes its reply.
func TestSyncScriptReplies(t *testing.T) {
	ctx := context.Background()
	servers := map[string]string{
		"redis-server": redistest.StartReal(t, "the struct library is a real redis-server's").Addr,
		"miniredis":    miniredis.RunT(t).Addr(),
	}
	const w = 60_000
	end := (time.Now().UnixMilli()/w + 1) * w
	now := end - w/4 // the script's clock is its argument
	big := int64(1) << 40
	me, other := "mmmmmmmmmmmmm", "ooooooooooooo"
	// a: a count of a window the instance's clock left a window ago, so
	// dropped. b: another instance counted big and holds a live lease of
	// 3. c: banned for 5 s. d: in the instance's first rounds of the
	// window (waiting), so the first spare share of the other instance of
	// two, not counted yet, is held back: of max 100, 25, which leaves a
	// spare share of 17 after a lease of 10 (23 with nothing held back).
	// e: Redis has no count of this instance where it wrote one (known), so
	// it leases no more than its pace, 3, and no spare share.
	items := []syncItem{
		{end: end - 2*w, mine: 2, prev: -1, max: 1 << 50, weighs: -1},
		{end: end, mine: 7, prev: -1, max: 1 << 50, want: 4, pace: 100, weighs: -1},
		{end: end, mine: 1, prev: -1, max: 10, weighs: -1, bans: true},
		{end: end, prev: -1, max: 100, want: 10, pace: 100, weighs: -1, waiting: true},
		{end: end, prev: -1, max: 100, want: 10, pace: 3, weighs: -1, known: true},
	}
	for i, k := range []string{"a", "b", "c", "d", "e"} {
		items[i].key, items[i].length, items[i].window, items[i].prevLength = "t:{"+k+"}:g", w, w, w
	}
	got := map[string][]syncReplies{}
	for name, addr := range servers {
		client := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { client.Close() })
		s := &SyncStore{table: newSyncTable(time.Second, SyncShare, me, 100, 0)}
		s.client, s.prefix = client, "t:"
		s.table.fleet.Store(2)
		for _, err := range []error{
			client.HSet(ctx, s.windowKey("0", end, w), "t:{b}:g", appendRecord(nil, other, big, 3, now+w)).Err(),
			client.Set(ctx, "t:{c}:b", 1, 5*time.Second).Err(),
			syncScript.Load(ctx, client).Err(),
		} {
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		res, err := client.Do(ctx, s.syncArgs(items, now)...).Text()
		if err != nil {
			t.Fatalf("%s: the sync script: %v", name, err)
		}
		if len(res) != syncReplySize*len(items) {
			t.Fatalf("%s: %d bytes of replies for %d keys", name, len(res), len(items))
		}
		for i := range items {
			got[name] = append(got[name], readReplies(res[syncReplySize*i:]))
		}
		// What the script wrote reads back: this instance's count and
		// lease beside the other's.
		recs, err := readRecords(client.HGet(ctx, s.windowKey("0", end, w), "t:{b}:g").Val(), len(me))
		if err != nil || len(recs) != 2 || recs[0] != (syncRecord{other, big, 3, now + w}) || recs[1].id != me || recs[1].count != 7 || recs[1].leased < big {
			t.Errorf("%s: b's records read %+v (%v)", name, recs, err)
		}
	}
	for name, r := range got {
		if r[0].total != -1 {
			t.Errorf("%s: a dropped window's total reads %d, want -1", name, r[0].total)
		}
		if r[1].total != big+7 || r[1].held != 3 || r[1].lease != 4 || r[1].spare < big {
			t.Errorf("%s: total %d, held %d, lease %d, spare %d; want %d, 3, 4 and more than %d",
				name, r[1].total, r[1].held, r[1].lease, r[1].spare, big+7, big)
		}
		if r[2].total != 1 || r[2].ban <= 0 || r[2].ban > 5000 {
			t.Errorf("%s: total %d, ban %d ms; want 1 and up to 5000", name, r[2].total, r[2].ban)
		}
		if r[3].lease != 10 || r[3].spare != 17 {
			t.Errorf("%s: waiting: lease %d, spare %d; want 10 and 17", name, r[3].lease, r[3].spare)
		}
		if r[4].lease != 3 || r[4].spare != 0 {
			t.Errorf("%s: known, not counted: lease %d, spare %d; want 3 and 0", name, r[4].lease, r[4].spare)
		}
	}
	if a, b := got["redis-server"], got["miniredis"]; a[0] != b[0] || a[1] != b[1] || a[2].total != b[2].total || a[3] != b[3] || a[4] != b[4] {
		t.Errorf("redis-server read %+v, miniredis %+v", a, b)
	}
}
