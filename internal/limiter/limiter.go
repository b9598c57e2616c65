// Package limiter holds the rate limiter's algorithms: fixed and sliding
// windows, the atomic decision over several limits, and the stores that keep
// the counters (in memory, and in Redis with its scripts). It imports no
// Caddy package, so the compiler keeps the algorithms apart from the Caddy
// module that drives them.
package limiter

import (
	"context"
	"time"
)

// Limit is the quota a store enforces for one decision: at most Max requests
// per key in each Window. It is passed with every Hit rather than fixed when
// the store is built, so a config reload that changes window or max applies at
// once to a store that keeps its counts.
type Limit struct {
	// Window is the length of one window. It must be positive.
	Window time.Duration
	// Max is the number of requests admitted per key per window. It must be
	// at least 1.
	Max int
	// Since is when Window took its value (a config reload that changed
	// it). A store cuts a window that ends more than a Window after a
	// request to Since+Window; the zone cuts every other running window
	// when the window shrinks (MemoryStore.CutWindows,
	// RedisStore.CutWindows). Zero: such a window ends a Window after the
	// key's next request at the latest.
	Since time.Time
	// Algorithm is how the limit counts: FixedWindow (the zero value),
	// SlidingWindow or GCRA.
	Algorithm Algorithm
	// Burst is, for GCRA, how many requests a key with a full bucket may
	// send at once. 0 means Max.
	Burst int
	// Ban, when positive, refuses a key that goes over the limit for this
	// long from its first refusal, whatever its window says.
	Ban time.Duration
	// BanMax, when above Ban, escalates bans: each violation within a day
	// of the key's previous one doubles its ban, up to BanMax.
	BanMax time.Duration
	// Calendar, when set, aligns the limit's windows (fixed or sliding) to
	// the calendar: each ends at Calendar.End, and Window is the unit's
	// nominal length. Nil: a window runs from a key's request for Window.
	Calendar *Calendar
}

// BanStrikeMemory is how long a key's violations count towards an
// escalated ban: a violation more than this after the previous one starts
// again from Ban.
const BanStrikeMemory = 24 * time.Hour

// banFor returns the ban of a key's strikes-th violation in a row.
func (l *Limit) banFor(strikes int64) time.Duration {
	d := l.Ban
	for ; strikes > 1 && d < l.BanMax; strikes-- {
		d *= 2
	}
	if l.BanMax > l.Ban {
		d = min(d, l.BanMax)
	}
	return d
}

// interval returns, for GCRA, the time one request takes to drip back.
func (l *Limit) interval() int64 {
	return max(int64(l.Window)/int64(max(l.Max, 1)), 1)
}

// burst returns, for GCRA, the bucket's size in requests.
func (l *Limit) burst() int64 {
	if l.Burst > 0 {
		return int64(l.Burst)
	}
	return int64(l.Max)
}

// End returns when a window that would end at reset (Unix nanoseconds) ends
// under l at t. Only a window begun under a longer Window, one that would
// end more than a Window after t, is cut short; for a calendar window, to the
// end of the calendar window holding t.
func (l Limit) End(reset, t int64) int64 {
	if reset-t <= int64(l.Window) {
		return reset
	}
	if l.Calendar != nil {
		// Past a nominal window (a DST day's first hour, or a window a
		// config without the calendar began): never past the calendar
		// window holding t.
		return min(reset, l.Calendar.End(t))
	}
	return min(reset, l.cutoff(t))
}

// cutoff returns when, at t, a window begun under a longer Window ends at the
// latest (Unix nanoseconds; at or before t when it has ended).
func (l Limit) cutoff(t int64) int64 {
	if l.Since.IsZero() {
		return t + int64(l.Window)
	}
	return l.Since.UnixNano() + int64(l.Window)
}

// length returns the length of the window that ends at reset: Window, or
// the calendar window's.
func (l Limit) length(reset int64) int64 {
	if l.Calendar != nil {
		return reset - l.Calendar.Start(reset-1)
	}
	return int64(l.Window)
}

// next returns the length of the window that follows the one ending at
// reset.
func (l Limit) next(reset int64) int64 {
	if l.Calendar != nil {
		return l.Calendar.End(reset) - reset
	}
	return int64(l.Window)
}

// windowArgs returns, for a Redis script, the window in milliseconds and the
// cutoff (cutoffIn) at now; for a calendar window both are what is left of
// the calendar window holding now, at least 1ms, so that the count key
// expires at the calendar's boundary.
func (l Limit) windowArgs(now time.Time) (window, cutoff int64) {
	if l.Calendar != nil {
		left := max((l.Calendar.End(now.UnixNano())-now.UnixNano()+int64(time.Millisecond)-1)/int64(time.Millisecond), 1)
		return left, left
	}
	return l.Window.Milliseconds(), l.cutoffIn(now).Milliseconds()
}

// cutoffIn is cutoff as a time left from now, at most Window; it uses the
// monotonic clock where now and Since have it, so a wall clock stepped back
// never lengthens a window.
func (l Limit) cutoffIn(now time.Time) time.Duration {
	if l.Since.IsZero() {
		return l.Window
	}
	return min(l.Since.Add(l.Window).Sub(now), l.Window)
}

// Defaults of the stores' options left unset.
const (
	DefaultMaxTracked = 100_000                // keys a store tracks at most
	DefaultTimeout    = 100 * time.Millisecond // a Redis decision's round trip
)

// MaxChecks is the most limits one decision may hold.
const MaxChecks = 8

// Check is one limit of a decision: the client key it counts and the quota
// that key is held to. The limits of one zone keep apart counters for one
// key: the memory store by Slot (0 to MaxChecks-1), the Redis store by Name
// ("" for a zone's first limit, whose keys are those a zone of one limit
// has always written). A Name is at most 255 bytes (sync mode's table
// keeps its length in a byte; the module allows 32).
type Check struct {
	Slot  int
	Name  string
	Key   string
	Limit Limit
	// Cost is how many units of the quota the request spends; 0 means 1
	// unless Free is set. A request that costs more than the quota left
	// is refused and spends nothing.
	Cost int
	// Free makes the request cost nothing (a cost of 0): it reads the
	// key's quota without spending it, admitted unless the key is banned
	// or already past its max (a plan lowered it).
	Free bool
	// MaxInFlight caps the requests of Key the limit lets in flight at
	// once; 0: no cap. An admitted decision takes one of the key's slots
	// in each check that has a cap, which Release gives back; a check
	// whose key holds them all refuses the request (Verdict.InFlightFull),
	// and nothing is spent in any check.
	MaxInFlight int
	// Lease names the slot an admitted check with a MaxInFlight holds in a
	// store that keeps them as leases (Redis): Decide sets it, Release
	// gives it back. Empty elsewhere.
	Lease string
	// force makes a decision spend Cost whatever the key has left: a
	// charge a response reported (Store.Charge). Such a check is always
	// admitted, tallies no refusal, starts and heeds no ban and takes no
	// slot of MaxInFlight.
	force bool
	// NoBan keeps a refusal from starting a ban (Limit.Ban): other
	// requests of the key hold units while they are served, and may give
	// them back (count_status), or the handler only tries its limits (dry
	// run). A refusal that would have started one says so
	// (Verdict.PendingBan). A running ban still refuses.
	NoBan bool
}

// cost returns what the check spends when admitted: 0 when Free, else
// Cost, at least 1.
func (c *Check) cost() int64 {
	if c.Free {
		return 0
	}
	return int64(max(c.Cost, 1))
}

// Verdict is a store's answer to one Hit: whether the request is admitted and
// the quota figures the handler turns into response headers.
type Verdict struct {
	// Allowed reports whether the request is admitted.
	Allowed bool
	// Max is the Max of the Limit the decision was made against.
	Max int
	// Remaining is Max minus the requests admitted in this window, never
	// negative.
	Remaining int
	// Reset is when the key's current window ends.
	Reset time.Time
	// RetryAfter is how long a refused client should wait: the time left until
	// Reset. It is zero when the request is admitted.
	RetryAfter time.Duration
	// FirstRefusal is true for the first refused request of a key in a window,
	// so the handler logs and reports a key going over its limit once, not once
	// per refused request.
	FirstRefusal bool
	// PendingBan is true for a refusal that would have started a ban
	// (Limit.Ban) had the check not been NoBan: the caller decides later
	// whether it stands (Store.Ban).
	PendingBan bool
	// InFlightFull is true when the check refused the request because its
	// key has MaxInFlight requests in flight: RetryAfter is a second, and
	// the refusal is no violation (no ban, no refused tally).
	InFlightFull bool
	// StoreError is true when the shared store failed and the verdict was
	// reached without it, as the store's on_error setting says (admitted
	// anyway, or decided by an in-process fallback store).
	StoreError bool
}

// KeyState is one tracked key as the admin API lists it.
type KeyState struct {
	// Key is the client key (an IP address, an IPv6 prefix or the value of a
	// custom key placeholder).
	Key string
	// Count is the number of requests admitted in the current window.
	Count int
	// Refused is the number of requests refused in the current window.
	Refused int
	// InFlight is the key's requests in flight in the limit (with a
	// MaxInFlight; this process's, on the memory store).
	InFlight int
	// Reset is when the current window ends.
	Reset time.Time
	// Prev is, for a sliding window, the requests admitted in the previous
	// window, which still weigh on this one (Limit.Weigh); 0 otherwise.
	Prev int
	// Name is the limit the key is counted in: "" for a zone's first limit,
	// else the name of its Check.
	Name string
	// BannedUntil is when the key's ban ends (Limit.Ban); zero when it is
	// not banned.
	BannedUntil time.Time
}

// Algorithm is how a Limit counts.
type Algorithm uint8

// The algorithms.
const (
	// FixedWindow counts each window's requests from zero.
	FixedWindow Algorithm = iota
	// SlidingWindow is the sliding-window counter: the previous window's
	// count, weighted by how much of it a window ending now would still
	// overlap, plus the current window's count, must stay within Max.
	SlidingWindow
	// GCRA is the generic cell rate algorithm, a token bucket kept as one
	// timestamp per key (its theoretical arrival time): Max requests per
	// Window as a steady rate, one every Window/Max, with bursts of up to
	// Burst.
	GCRA
)

// Sliding reports whether l is a sliding window.
func (l Limit) Sliding() bool { return l.Algorithm == SlidingWindow }

// GCRA reports whether l is a GCRA bucket.
func (l Limit) GCRA() bool { return l.Algorithm == GCRA }

// Store keeps the per-key counters of one zone: what every store does.
// What only a store shared by a fleet does is in Fleet and Syncer.
// Implementations are safe for concurrent use.
type Store interface {
	// Decide judges one request against every check at once, atomically,
	// and writes check i's verdict to out[i] (out is at least as long as
	// checks, which hold at most MaxChecks). The request is admitted when
	// every verdict is; then each check's count goes up by its cost.
	// Otherwise no count goes up, and each refusing check tallies a
	// refusal.
	Decide(ctx context.Context, checks []Check, now time.Time, out []Verdict) error

	// Refund gives back, at now, what an admitted decision spent in each
	// check (its Cost), for a request that turned out not to count (a
	// response status outside count_status). verdicts are Decide's. A
	// window that ended since is left alone: the units went with it (in a
	// sliding window they go on weighing as the previous count); a GCRA
	// bucket gets back only what has not dripped back since.
	Refund(ctx context.Context, checks []Check, now time.Time, verdicts []Verdict) error

	// Charge settles, at now, what admitted decisions' responses reported
	// they cost (the response's charge) beside what they spent: check i's
	// Cost units more are spent in its key's running window, whatever is
	// left (the window the decision was made in, or the key's next one
	// when that has ended), with no refusal and no ban; a negative Cost
	// gives units back as Refund does. verdicts are Decide's. Charge may
	// rewrite checks and verdicts. A store shared over the network sends
	// it off the caller's path and may return before it lands.
	Charge(ctx context.Context, checks []Check, now time.Time, verdicts []Verdict) error

	// Release gives back the slot an admitted decision took in each check
	// that has a MaxInFlight: once per admitted decision, when its request
	// ends.
	Release(ctx context.Context, checks []Check) error

	// Ban records, at now, a violation of c's limit by c.Key (c.Limit
	// bans) and bans the key from now, escalating as the limit says: a
	// violation that a refusal reported as PendingBan and that turned out
	// to stand. It returns when the ban ends (zero when the store holds
	// no room for it).
	Ban(ctx context.Context, c Check, now time.Time) (time.Time, error)

	// Len returns the number of keys tracked in this process, expired
	// windows included until they are purged.
	Len() int

	// Range calls fn for every key whose window has not expired at now, in no
	// particular order, until fn returns false. It never holds a lock across
	// the whole store.
	Range(ctx context.Context, now time.Time, fn func(KeyState) bool) error

	// RangeLen returns at least the number of KeyStates Range would list
	// now, give or take keys being added meanwhile, so a reader can tell a
	// request that reaches past every key before paying for the scan; ok
	// is false when the store cannot tell without one.
	RangeLen() (n int, ok bool)

	// Forget drops key at once from every limit, so its next request
	// starts fresh windows. It reports whether the key was tracked.
	Forget(ctx context.Context, key string) (bool, error)

	// ForgetCheck drops c.Key from c's limit only (c.Limit is not read).
	// A ban and the violations that escalate it go too.
	ForgetCheck(ctx context.Context, c Check) (bool, error)

	// Configure applies the settings the zone runs with: a reload calls
	// it again, and the store keeps its counts. A limit whose algorithm
	// changed (to or from GCRA) starts afresh.
	Configure(s Settings)

	// CutWindows ends, by cutoff at the latest, the running windows of the
	// limit c names (c.Slot and c.Name) that would end after it: a reload
	// shortened the window. A Fleet store is cut only once a handler
	// serves, so that a config that is only validated cuts nothing.
	CutWindows(ctx context.Context, c Check, cutoff time.Time) error

	// Run does the store's background work until ctx ends: sweeping
	// expired windows every interval(), and for a Fleet store its health
	// probes and sync rounds.
	Run(ctx context.Context, interval func() time.Duration)

	// Evictions counts the live keys evicted to make room since the store
	// was created.
	Evictions() uint64

	// HashedKeys reports whether the store keeps keys as HMAC hashes
	// (hash_keys), so that Range lists hashes; Tag returns a key as the
	// store keeps it.
	HashedKeys() bool
	Tag(key string) string
}

// Settings are what a zone runs its store with: those of its newest
// handler (Store.Configure).
type Settings struct {
	// MaxTracked bounds the keys the store tracks in this process.
	MaxTracked int
	// Limits are the zone's limits, the first limit first: the Slot, Name
	// and Limit of each (Key is not read).
	Limits []Check
	// Timeout bounds each decision's round trip to a Fleet store
	// (DefaultTimeout when zero); OnError is what it does when that fails
	// (OnErrorLocal when empty). A memory store reads neither.
	Timeout time.Duration
	OnError string
	// LeaseTTL is how long a Fleet store's lease of a request in flight
	// (MaxInFlight) lives unless renewed: a dead instance's lapse after it.
	LeaseTTL time.Duration
}

// sliding returns the requests the sliding-window counter holds against a
// key at t: prev weighted by the part of the previous window that a window
// ending at t would still overlap (the window in progress ends at reset),
// plus count.
func (l Limit) sliding(prev, count int64, reset, t int64) float64 {
	left := float64(reset-t) / float64(l.length(reset))
	return float64(prev)*min(max(left, 0), 1) + float64(count)
}

// Weigh returns the requests the key's window holds against the limit at
// now, and whether one more would be refused: its count, or for a sliding
// window the weighted previous count plus the count.
func (l Limit) Weigh(ks KeyState, now time.Time) (float64, bool) {
	if ks.BannedUntil.After(now) {
		return float64(max(ks.Count, l.Max)), true
	}
	if l.GCRA() {
		// The bucket is empty at Reset, the key's theoretical arrival
		// time: what it holds is the time to it in intervals.
		held := float64(ks.Reset.Sub(now)) / float64(l.interval())
		return max(held, 0), held+1 > float64(l.burst())
	}
	if !l.Sliding() {
		return float64(ks.Count), ks.Count >= l.Max
	}
	est := l.sliding(int64(ks.Prev), int64(ks.Count), ks.Reset.UnixNano(), now.UnixNano())
	return est, est+1 > float64(l.Max)
}

// slidingWait returns how long after t a key of the sliding-window counter
// (prev, count, window ending at reset) waits until a request of cost units
// fits.
func (l Limit) slidingWait(prev, count int64, reset, t, cost int64) time.Duration {
	w := float64(l.length(reset))
	m := float64(l.Max)
	c := float64(cost)
	if count+cost <= int64(l.Max) {
		if prev == 0 {
			return 0
		}
		// prev*(reset-t')/w + count + cost <= max
		at := float64(reset) - (m-float64(count)-c)*w/float64(prev)
		return time.Duration(max(at-float64(t), 0))
	}
	// In the next window prev is count and the new count 0.
	w = float64(l.next(reset))
	at := float64(reset) + w - (m-c)*w/float64(max(count, 1))
	return time.Duration(max(at-float64(t), 1))
}
