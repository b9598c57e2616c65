package ratelimit

import "testing"

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
