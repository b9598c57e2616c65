package limiter

import "time"

// Calendar windows: a fixed window that runs from one calendar boundary to
// the next in a time zone (an hour from :00, a day from midnight, a week
// from Monday, a month from the 1st) rather than from a key's first
// request. Days and months vary in length (DST, 28 to 31 days), so a
// calendar window's end is computed from the calendar, never from a
// length.

// CalendarUnit is the span of a calendar window.
type CalendarUnit uint8

// Calendar units.
const (
	CalendarHour CalendarUnit = iota + 1
	CalendarDay
	CalendarWeek
	CalendarMonth
)

// Calendar aligns a limit's fixed windows to the calendar of a time zone.
type Calendar struct {
	Unit CalendarUnit
	Loc  *time.Location
}

// End returns when the calendar window holding t (Unix nanoseconds) ends.
func (c *Calendar) End(t int64) int64 { return c.bound(t, 1) }

// Start returns when the calendar window holding t began.
func (c *Calendar) Start(t int64) int64 { return c.bound(t, 0) }

// bound returns the start of the calendar window holding t, or with next
// 1 the start of the one after it.
func (c *Calendar) bound(t int64, next int) int64 {
	at := time.Unix(0, t).In(c.Loc)
	switch c.Unit {
	case CalendarHour:
		// From the zone's :00, which the offset at t places: a zone a
		// half hour off UTC has its hours at :30 UTC. Offsets change by
		// whole hours at DST, so the hours stay an hour long.
		_, off := at.Zone()
		h, o := int64(time.Hour), int64(off)*int64(time.Second)
		local := t + o
		return local - ((local%h)+h)%h + int64(next)*h - o
	case CalendarDay:
		y, m, d := at.Date()
		return time.Date(y, m, d+next, 0, 0, 0, 0, c.Loc).UnixNano()
	case CalendarWeek:
		y, m, d := at.Date()
		days := (int(at.Weekday()) + 6) % 7 // since Monday
		return time.Date(y, m, d-days+7*next, 0, 0, 0, 0, c.Loc).UnixNano()
	default:
		y, m, _ := at.Date()
		return time.Date(y, m+time.Month(next), 1, 0, 0, 0, 0, c.Loc).UnixNano()
	}
}
