package ratelimit

import (
	"context"
	"net/http"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"
	"unsafe"

	"github.com/caddyserver/caddy/v2"
)

// heapInUse returns the bytes of live heap objects after a collection.
func heapInUse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// Under a flood of 1,000,000 distinct keys refused once each, the summary
// keeps its 256 entries and its memory, and an offender refused 10,000
// times in the middle of the flood is listed first, with its refusals.
// Keys reach the summary as requests do, in a buffer that is reused.
func TestOffendersFlood(t *testing.T) {
	o := new(offenders)
	start := time.Unix(1_800_000_000, 0)
	const flood, offender, every = 1_000_000, "203.0.113.66", 100
	buf := make([]byte, 0, 32)
	before := heapInUse()
	for i := range flood {
		now := start.Add(time.Duration(i) * 100 * time.Microsecond) // 100 s in all
		buf = strconv.AppendInt(append(buf[:0], "10."...), int64(i), 10)
		o.refused(unsafe.String(&buf[0], len(buf)), "api", now)
		if i%every == 0 {
			o.refused(offender, "burst", now)
		}
	}
	after := heapInUse()
	t.Logf("heap before the flood %d B, after %d B (the summary itself: %d B)", before, after, unsafe.Sizeof(*o))
	if after > before+256<<10 {
		t.Errorf("heap grew from %d to %d B over the flood: the summary is not bounded", before, after)
	}

	got := o.list(start.Add(100 * time.Second))
	if len(got) > offenderShards*offenderSlots {
		t.Fatalf("%d offenders listed, want at most %d", len(got), offenderShards*offenderSlots)
	}
	if len(got) == 0 || got[0].key != offender || got[0].limit != "burst" {
		t.Fatalf("first offender = %+v, want %s refused by burst", got[:min(len(got), 3)], offender)
	}
	// Never more than it was refused, and no more lost than a few
	// sampled-out refusals.
	if n := got[0].refusals; n > flood/every || n < flood/every-64 {
		t.Errorf("%s: %d refusals, want about %d", offender, n, flood/every)
	}
	seen := map[string]bool{}
	for _, r := range got[1:] {
		if r.refusals != 1 {
			t.Errorf("flood key %q: %d refusals, want 1 (each was refused once)", r.key, r.refusals)
			break
		}
		if seen[r.key] {
			t.Fatalf("flood key %q listed twice: the summary kept the caller's buffer, not a copy", r.key)
		}
		seen[r.key] = true
	}
}

// Recording a refusal allocates nothing, for a key in the summary or a new
// one replacing another.
func TestOffendersRefusedAllocatesNothing(t *testing.T) {
	o := new(offenders)
	now := time.Unix(1_800_000_000, 0)
	for i := range 1000 {
		o.refused("192.0.2."+strconv.Itoa(i), "api", now)
	}
	buf := []byte("key:" + string(make([]byte, maxCustomKeyLen)))
	i := 0
	if n := testing.AllocsPerRun(1000, func() {
		o.refused("192.0.2.1", "api", now)
		buf[4+i%maxCustomKeyLen]++
		i++
		o.refused(unsafe.String(&buf[0], len(buf)), "api", now) // new each time, the longest custom key
	}); n != 0 {
		t.Errorf("%.1f allocations per refusal", n)
	}
}

// A key is listed until OffenderAge after its last refusal; refused after
// that, it counts afresh. An unblock drops it.
func TestOffendersAge(t *testing.T) {
	t.Parallel()
	o := new(offenders)
	t0 := time.Unix(1_800_000_000, 0)
	for range 3 {
		o.refused("192.0.2.1", "api", t0)
	}
	if got := o.list(t0.Add(OffenderAge)); len(got) != 1 || got[0].refusals != 3 || !got[0].last.Equal(t0) {
		t.Errorf("at OffenderAge: %+v, want 192.0.2.1 with 3 refusals at %v", got, t0)
	}
	if got := o.list(t0.Add(OffenderAge + time.Second)); len(got) != 0 {
		t.Errorf("past OffenderAge: %+v, want none", got)
	}
	later := t0.Add(OffenderAge + time.Second)
	o.refused("192.0.2.1", "burst", later)
	if got := o.list(later); len(got) != 1 || got[0].refusals != 1 || got[0].limit != "burst" {
		t.Errorf("refused again after aging out: %+v, want 1 refusal by burst", got)
	}
	if o.forget("api", func(k string) bool { return k == "192.0.2.1" }) {
		t.Error("forget in api dropped a key burst refused last")
	}
	if !o.forget("", func(k string) bool { return k == "192.0.2.1" }) || len(o.list(later)) != 0 {
		t.Errorf("after forget: %+v, want none", o.list(later))
	}
}

// The case: with max 5 a minute and a burst limit of 2 a second,
// a client refused 28 times by the burst limit is, ten seconds later,
// first among the offenders, while the default order shows it below keys
// that were never refused, with refused 0.
func TestOffendersOutliveTheirWindow(t *testing.T) {
	t.Parallel()
	const zoneName = "offenders-outlive"
	rl, _ := provisionHandler(t, zoneName, 5, true, func(rl *RateLimit) {
		rl.Limits = []PolicyConfig{{Name: "burst", Max: 2, Window: caddy.Duration(time.Second)}}
	})
	refusals := 0
	for range 30 {
		if serve(t, rl, "203.0.113.7") == http.StatusTooManyRequests {
			refusals++
		}
	}
	if refusals != 28 {
		t.Fatalf("203.0.113.7: %d of 30 requests refused, want 28", refusals)
	}
	for _, ip := range []string{"192.0.2.1", "192.0.2.2"} {
		hitN(t, rl, ip, 5) // busy, never refused
	}
	hitN(t, rl, "198.51.100.3", 5)
	for range 3 {
		serve(t, rl, "198.51.100.3") // refused by the minute's limit
	}
	// Refused by both limits at once: one refusal per request.
	serve(t, rl, "198.51.100.4")
	serve(t, rl, "198.51.100.4")
	hitN(t, rl, "198.51.100.4", 3)
	for range 4 {
		serve(t, rl, "198.51.100.4")
	}

	later := time.Now().Add(10 * time.Second)
	list := func(query map[string]string) KeyList {
		t.Helper()
		q, err := parseListQuery(query)
		if err != nil {
			t.Fatal(err)
		}
		l, err := rl.zone.list(context.Background(), q, later)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}

	byCount := list(map[string]string{"policy": zoneName})
	if n := len(byCount.Keys); n != 5 || byCount.Keys[n-1].Key != "203.0.113.7" || byCount.Keys[n-1].Refused != 0 || byCount.Keys[n-1].RecentRefusals != 0 {
		t.Errorf("default order: %+v, want 203.0.113.7 last, refused 0, no recent refusals", byCount.Keys)
	}

	recent := list(map[string]string{"sort": SortRecentRefusals})
	type row struct {
		key, policy    string
		recent         int64
		count, refused int
		limited        bool
	}
	var got []row
	for _, k := range recent.Keys {
		got = append(got, row{k.Key, k.Policy, k.RecentRefusals, k.Count, k.Refused, k.Limited})
		if k.LastRefused < later.Unix()-11 || k.LastRefused > later.Unix()-9 {
			t.Errorf("%s: last refused %d, want about %d", k.Key, k.LastRefused, later.Unix()-10)
		}
	}
	want := []row{
		{"203.0.113.7", "burst", 28, 0, 0, false}, // its burst window ended: no live count
		{"198.51.100.4", zoneName, 4, 5, 4, true},
		{"198.51.100.3", zoneName, 3, 5, 3, true},
	}
	if !slices.Equal(got, want) || recent.Total != 3 {
		t.Errorf("by recent refusals (total %d):\n got %+v\nwant %+v", recent.Total, got, want)
	}
	if k := recent.Keys[0]; k.Reset != 0 || k.Remaining != 2 || k.Unblock != "/rate_limit/"+zoneName+"?key=203.0.113.7" {
		t.Errorf("a key only among offenders: %+v, want reset 0, remaining 2 (the burst quota), its unblock", k)
	}
	if l := list(map[string]string{"sort": SortRecentRefusals, "policy": "burst"}); l.Total != 1 || l.Keys[0].Key != "203.0.113.7" {
		t.Errorf("by recent refusals in burst: %+v, want 203.0.113.7 only", l)
	}
	if l := list(map[string]string{"sort": SortRecentRefusals, "limited": "true", "offset": "1", "limit": "1"}); l.Total != 2 || len(l.Keys) != 1 || l.Keys[0].Key != "198.51.100.3" {
		t.Errorf("limited, second page of 1: %+v, want 198.51.100.3 of 2", l)
	}
}

// Through the admin API: sort is checked, and an unblock drops a key only
// among the offenders, which has no live count.
func TestAdminRecentRefusals(t *testing.T) {
	t.Parallel()
	rl, _ := provisionHandler(t, "admin-recent", 5, true)
	rl.zone.offenders.refused("192.0.2.9", "admin-recent", time.Now())

	_, err := adminDo(t, http.MethodGet, "/rate_limit/admin-recent?sort=refused")
	wantAPIError(t, err, http.StatusBadRequest, `invalid sort "refused": must be count or recent_refusals`)

	var byCount KeyList
	adminGet(t, "/rate_limit/admin-recent?sort=count", &byCount)
	if byCount.Total != 0 {
		t.Errorf("sort=count: %+v, want no tracked key", byCount)
	}
	var recent KeyList
	adminGet(t, "/rate_limit/admin-recent?sort=recent_refusals", &recent)
	if recent.Total != 1 || recent.Keys[0].Key != "192.0.2.9" || recent.Keys[0].RecentRefusals != 1 || recent.Keys[0].Count != 0 || recent.Keys[0].Remaining != 5 {
		t.Fatalf("sort=recent_refusals: %+v, want 192.0.2.9, 1 refusal, no live count, 5 remaining", recent)
	}
	if w, err := adminDo(t, http.MethodDelete, recent.Keys[0].Unblock); err != nil || w.Code != http.StatusOK {
		t.Fatalf("DELETE %s: %v %d", recent.Keys[0].Unblock, err, w.Code)
	}
	adminGet(t, "/rate_limit/admin-recent?sort=recent_refusals", &recent)
	if recent.Total != 0 {
		t.Errorf("after the unblock: %+v, want none", recent)
	}
	_, err = adminDo(t, http.MethodDelete, "/rate_limit/admin-recent?key=192.0.2.9")
	wantAPIError(t, err, http.StatusNotFound, "not tracked")
}

// BenchmarkOffendersRefused is what a refusal adds to the handler for the
// summary: a key already in it, and a flood of new keys each refused once.
func BenchmarkOffendersRefused(b *testing.B) {
	now := time.Unix(1_800_000_000, 0)
	b.Run("tracked", func(b *testing.B) {
		o := new(offenders)
		b.ReportAllocs()
		for b.Loop() {
			o.refused("203.0.113.9", "api", now)
		}
	})
	b.Run("flood", func(b *testing.B) {
		o := new(offenders)
		buf := make([]byte, 0, 32)
		i := 0
		b.ReportAllocs()
		for b.Loop() {
			buf = strconv.AppendInt(append(buf[:0], "10."...), int64(i), 10)
			i++
			o.refused(unsafe.String(&buf[0], len(buf)), "api", now)
		}
	})
}
