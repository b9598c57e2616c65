package limiter

import (
	"testing"
	"time"
)

// A calendar window ends at the calendar's next boundary in its zone,
// whatever the length of the day or the month.
func TestCalendarEnd(t *testing.T) {
	t.Parallel()
	berlin, _ := time.LoadLocation("Europe/Berlin")
	kolkata, _ := time.LoadLocation("Asia/Kolkata")
	for _, tc := range []struct {
		unit     CalendarUnit
		loc      *time.Location
		at, want string
	}{
		{CalendarHour, time.UTC, "2026-12-02T14:37:10Z", "2026-12-02T15:00:00Z"},
		{CalendarHour, time.UTC, "2026-12-02T14:00:00Z", "2026-12-02T15:00:00Z"},
		{CalendarHour, kolkata, "2026-12-02T14:37:10Z", "2026-12-02T15:30:00Z"}, // +05:30: :00 there is :30 UTC
		// The hour Berlin repeats when DST ends: each is an hour.
		{CalendarHour, berlin, "2026-10-25T00:30:00Z", "2026-10-25T01:00:00Z"},
		{CalendarHour, berlin, "2026-10-25T01:30:00Z", "2026-10-25T02:00:00Z"},
		{CalendarDay, berlin, "2026-12-02T23:30:00Z", "2026-12-03T23:00:00Z"},
		// The 25-hour day and the 23-hour one.
		{CalendarDay, berlin, "2026-10-25T12:00:00Z", "2026-10-25T23:00:00Z"},
		{CalendarDay, berlin, "2026-03-29T12:00:00Z", "2026-03-29T22:00:00Z"},
		{CalendarWeek, time.UTC, "2026-12-02T14:00:00Z", "2026-12-07T00:00:00Z"}, // a Wednesday
		{CalendarWeek, time.UTC, "2026-12-07T00:00:00Z", "2026-12-14T00:00:00Z"}, // a Monday
		{CalendarMonth, time.UTC, "2026-02-10T00:00:00Z", "2026-03-01T00:00:00Z"},
		{CalendarMonth, time.UTC, "2028-02-29T23:59:59Z", "2028-03-01T00:00:00Z"},
		{CalendarMonth, berlin, "2026-12-31T23:30:00Z", "2027-01-31T23:00:00Z"}, // already January there
	} {
		at, _ := time.Parse(time.RFC3339, tc.at)
		c := &Calendar{Unit: tc.unit, Loc: tc.loc}
		if got := time.Unix(0, c.End(at.UnixNano())).UTC().Format(time.RFC3339); got != tc.want {
			t.Errorf("unit %d in %s at %s: ends %s, want %s", tc.unit, tc.loc, tc.at, got, tc.want)
		}
	}
}

// The memory store counts a calendar window from its boundary, not from
// the key's first request, and refuses until the next one.
func TestMemoryCalendarWindow(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(100)
	lim := Limit{Window: time.Hour, Max: 2, Calendar: &Calendar{Unit: CalendarHour, Loc: time.UTC}}
	at, _ := time.Parse(time.RFC3339, "2026-12-02T14:59:00Z")
	hit(t, s, "k", at, lim)
	hit(t, s, "k", at.Add(10*time.Second), lim)
	v := hit(t, s, "k", at.Add(20*time.Second), lim)
	if v.Allowed || v.Reset.UTC().Format(time.RFC3339) != "2026-12-02T15:00:00Z" || v.RetryAfter != 40*time.Second {
		t.Fatalf("third request at 14:59:20: %+v, want refused until 15:00", v)
	}
	// At 15:00 a new window: two more.
	if v := hit(t, s, "k", at.Add(time.Minute), lim); !v.Allowed || v.Remaining != 1 || v.Reset.UTC().Format(time.RFC3339) != "2026-12-02T16:00:00Z" {
		t.Fatalf("at 15:00: %+v, want admitted in the window to 16:00", v)
	}
}

// A sliding calendar window weighs the calendar window before by what is
// left of this one, whatever their lengths: 10 spent in February (28
// days), 14 days into March (31) weigh 10 × 17/31.
func TestMemoryCalendarSliding(t *testing.T) {
	t.Parallel()
	s := NewMemoryStore(100)
	lim := Limit{Window: 31 * 24 * time.Hour, Max: 10, Algorithm: SlidingWindow, Calendar: &Calendar{Unit: CalendarMonth, Loc: time.UTC}}
	feb, _ := time.Parse(time.RFC3339, "2026-02-20T00:00:00Z")
	for range 10 {
		hit(t, s, "k", feb, lim)
	}
	if v := hit(t, s, "k", feb, lim); v.Allowed || v.Reset.UTC().Format(time.RFC3339) != "2026-03-01T00:00:00Z" {
		t.Fatalf("the 11th in February: %+v, want refused, the window ending on March 1", v)
	}
	mar := time.Date(2026, 3, 15, 0, 0, 0, 0, time.UTC) // 17 of 31 days left
	v := hit(t, s, "k", mar, lim)
	// 10 × 17/31 = 5.48 held, so 4 fit and this is the first.
	if !v.Allowed || v.Remaining != 3 || v.Reset.UTC().Format(time.RFC3339) != "2026-04-01T00:00:00Z" {
		t.Fatalf("on March 15: %+v, want admitted with 3 left, the window ending on April 1", v)
	}
}
