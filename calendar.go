package ratelimit

import (
	"fmt"
	"time"
	_ "time/tzdata" // time zones on hosts without a zoneinfo database (a scratch container)

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// Calendar windows: a limit whose window is "hour", "day", "week" or
// "month" counts from one calendar boundary to the next in the handler's
// time zone (an hour from :00, a day from midnight, a week from Monday, a
// month from the 1st), so that "50 an hour, retry at 15:00" and a monthly
// quota are exact: fixed windows, or sliding ones that weigh the calendar
// window before.

// Calendar units, as window and limit take them.
const (
	CalendarHour  = "hour"
	CalendarDay   = "day"
	CalendarWeek  = "week"
	CalendarMonth = "month"
)

// calendarUnits are the calendar units, with each one's nominal window:
// its length in UTC, the longest month's for a month. RateLimit-Policy and
// the admin API show it as the window.
var calendarUnits = map[string]struct {
	unit   limiter.CalendarUnit
	window time.Duration
}{
	CalendarHour:  {limiter.CalendarHour, time.Hour},
	CalendarDay:   {limiter.CalendarDay, 24 * time.Hour},
	CalendarWeek:  {limiter.CalendarWeek, 7 * 24 * time.Hour},
	CalendarMonth: {limiter.CalendarMonth, 31 * 24 * time.Hour},
}

// DefaultTimeZone is the time zone of calendar windows when time_zone is
// not set: every instance of a fleet agrees on it, whatever its host's.
const DefaultTimeZone = "UTC"

// calendarWindow returns the nominal window of a calendar unit, or 0 for
// none.
func calendarWindow(calendar string) time.Duration {
	return calendarUnits[calendar].window
}

// calendarOf returns the limiter's calendar of a unit in loc, or nil for
// none.
func calendarOf(calendar string, loc *time.Location) *limiter.Calendar {
	u, ok := calendarUnits[calendar]
	if !ok {
		return nil
	}
	return &limiter.Calendar{Unit: u.unit, Loc: loc}
}

// timeZone returns the handler's time zone for calendar windows.
func (rl *RateLimit) timeZone() (*time.Location, error) {
	name := rl.TimeZone
	if name == "" {
		name = DefaultTimeZone
	}
	return time.LoadLocation(name)
}

// checkCalendars reports every invalid calendar setting, naming the
// option and its value.
func (rl *RateLimit) checkCalendars() []error {
	var errs []error
	calendars := 0
	check := func(what, calendar string, window time.Duration) {
		if calendar == "" {
			return
		}
		calendars++
		nominal := calendarWindow(calendar)
		switch {
		case nominal == 0:
			errs = append(errs, fmt.Errorf("invalid %s calendar %q: must be hour, day, week or month", what, calendar))
		case window != 0 && window != nominal:
			errs = append(errs, fmt.Errorf("invalid %s calendar %q with window %s: a calendar window's length is the calendar's; give one or the other", what, calendar, window))
		case rl.Algorithm == AlgorithmGCRA:
			errs = append(errs, fmt.Errorf("invalid %s calendar %q with algorithm %s: a GCRA bucket has no window to align", what, calendar, rl.Algorithm))
		}
	}
	check("window", rl.Calendar, time.Duration(rl.Window))
	for _, l := range rl.Limits {
		check(fmt.Sprintf("limit %q", l.Name), l.Calendar, time.Duration(l.Window))
	}
	if _, err := rl.timeZone(); err != nil {
		errs = append(errs, fmt.Errorf("invalid time_zone %q: %v (an IANA name such as Europe/Berlin)", rl.TimeZone, err))
	} else if rl.TimeZone != "" && calendars == 0 {
		errs = append(errs, fmt.Errorf("invalid time_zone %q: no limit has a calendar window (window hour, day, week or month)", rl.TimeZone))
	}
	return errs
}
