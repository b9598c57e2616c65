package limiter

import (
	"math"
	"time"
)

// memEntry is one key's window in one limit: 32 bytes and no pointers, so a
// large map costs the garbage collector nothing to scan.
type memEntry struct {
	reset   int64 // Unix nanoseconds at which the window ends
	seq     uint64
	count   int32 // requests admitted in the window (max is at most 1e9)
	refused int32 // requests refused in the window, saturating
	prev    int32 // sliding: requests admitted in the previous window
	span    int32 // sliding: the window in seconds, kept while prev counts; 0 for fixed
}

// expires returns when the entry holds nothing that counts any more: the end
// of its window, or for a sliding window a window later, while its count
// still weighs on the next window.
func (e memEntry) expires() int64 {
	return e.reset + int64(e.span)*int64(time.Second)
}

// roll moves the entry to the window holding t: a fixed window that has
// ended starts afresh; a sliding one keeps the count of the window just
// ended as prev. A window a reload shortened is cut first (Limit.end).
func (e *memEntry) roll(t int64, l *Limit) {
	e.reset = l.End(e.reset, t)
	if t < e.reset {
		return
	}
	if next := l.next(e.reset); l.Sliding() && t < e.reset+next {
		e.prev = e.count
		e.reset += next
	} else {
		e.prev = 0
		e.reset = t + int64(l.Window)
		if l.Calendar != nil {
			e.reset = l.Calendar.End(t)
		}
	}
	e.count, e.refused = 0, 0
	e.span = 0
	if l.Sliding() {
		e.span = l.span()
	}
}

// span is how long a sliding window's count weighs on after its window
// ends, in seconds: a window, the longest calendar window's with DST.
func (l *Limit) span() int32 {
	if l.Calendar != nil {
		return int32((l.Window + time.Hour) / time.Second)
	}
	return int32(l.Window / time.Second)
}

// admits reports whether the check's request (its cost) fits the entry's
// window at t.
func (e *memEntry) admits(t int64, c *Check) bool {
	l := &c.Limit
	switch {
	case l.GCRA():
		// A cost over the burst never fits (and would overflow below).
		return c.cost() <= l.burst() && max(e.reset, t)+c.cost()*l.interval()-t <= l.burst()*l.interval()
	case l.Sliding():
		return l.sliding(int64(e.prev), int64(e.count), e.reset, t)+float64(c.cost()) <= float64(l.Max)
	}
	return int64(e.count)+c.cost() <= int64(l.Max)
}

// spend counts the check's admitted request in the entry.
func (e *memEntry) spend(t int64, c *Check) {
	if c.Limit.GCRA() {
		e.reset = max(e.reset, t) + c.cost()*c.Limit.interval()
		e.refused = 0
		return
	}
	e.count = int32(min(int64(e.count)+c.cost(), math.MaxInt32))
}

// end returns when the entry's window ends; for GCRA, when its bucket is
// full again.
func (e *memEntry) end(t int64, l *Limit) int64 {
	if l.GCRA() {
		return max(e.reset, t)
	}
	return e.reset
}

// remaining returns how many more requests fit the entry's window at t.
func (e *memEntry) remaining(t int64, c *Check) int {
	l := &c.Limit
	switch {
	case l.GCRA():
		return int(max((l.burst()*l.interval()-(max(e.reset, t)-t))/l.interval(), 0))
	case l.Sliding():
		return int(max(float64(l.Max)-math.Ceil(l.sliding(int64(e.prev), int64(e.count), e.reset, t)), 0))
	}
	return int(max(int64(l.Max)-int64(e.count), 0))
}

// wait returns how long a refused key waits at t until its request fits.
func (e *memEntry) wait(t int64, c *Check) time.Duration {
	l := &c.Limit
	switch {
	case l.GCRA():
		if c.cost() > l.burst() {
			return l.Window // it never fits
		}
		return time.Duration(max(max(e.reset, t)+c.cost()*l.interval()-t-l.burst()*l.interval(), 1))
	case l.Sliding():
		return max(l.slidingWait(int64(e.prev), int64(e.count), e.reset, t, c.cost()), 1)
	}
	return time.Duration(e.reset - t)
}
