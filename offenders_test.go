package ratelimit

import (
	"runtime"
	"strconv"
	"testing"
	"time"
	"unsafe"
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
