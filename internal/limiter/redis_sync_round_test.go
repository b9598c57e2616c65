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
	// ag: Redis counts the window after the instance's next, so the
	// instance's count is dropped. bg: another instance counted big and
	// holds a live lease of 3. cg: banned for 5 s. dg: in the instance's
	// first rounds of the window (waiting), so the first spare share of
	// the other instance of two, not counted yet, is held back: of max
	// 100, 25, which leaves a spare share of 17 after a lease of 10 (23
	// with nothing held back). eg: Redis has no count of this instance
	// where it wrote one (known), so it leases no more than its pace, 3,
	// and no spare share.
	items := []syncItem{
		{end: end - w, window: w, mine: 2, prev: -1, max: 1 << 50, weighs: -1},
		{end: end, window: w, mine: 7, prev: -1, max: 1 << 50, want: 4, pace: 100, weighs: -1},
		{end: end, window: w, mine: 1, prev: -1, max: 10, weighs: -1, bans: true},
		{end: end, window: w, prev: -1, max: 100, want: 10, pace: 100, weighs: -1, waiting: true},
		{end: end, window: w, prev: -1, max: 100, want: 10, pace: 3, weighs: -1, known: true},
	}
	var nums []byte
	for i := range items {
		nums = items[i].appendNums(nums)
	}
	got := map[string][]syncReplies{}
	for name, addr := range servers {
		client := redis.NewClient(&redis.Options{Addr: addr})
		t.Cleanup(func() { client.Close() })
		for _, err := range []error{
			client.HSet(ctx, "ag", "=", end+w, "other", "5").Err(),
			client.HSet(ctx, "bg", "=", end, "other", strconv.FormatInt(big, 10)+"/3/"+strconv.FormatInt(now+w, 10)).Err(),
			client.Set(ctx, "cb", 1, 5*time.Second).Err(),
		} {
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
		}
		res, err := syncScript.Run(ctx, client, []string{"ag", "bg", "cg", "dg", "eg"}, now, "me", now+1000, 1, 2, 0, 0, nums).Text()
		if err != nil {
			t.Fatalf("%s: the sync script: %v", name, err)
		}
		if len(res) != syncReplySize*len(items) {
			t.Fatalf("%s: %d bytes of replies for %d keys", name, len(res), len(items))
		}
		for i := range items {
			got[name] = append(got[name], readReplies(res[syncReplySize*i:]))
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
