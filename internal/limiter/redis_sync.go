package limiter

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/maphash"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// How an instance in sync mode spends, between two rounds, what the fleet
// had left at the last.
const (
	// SyncShare spends at most what the last round leased this instance
	// (sized by its recent demand, lapsing unless renewed) and a spare
	// share of what no lease holds: half of it, divided among the
	// instances that synced recently.
	SyncShare = "share"
	// SyncAll spends all of it, as if no other instance spent meanwhile.
	SyncAll = "all"
)

// Bounds of the sync interval.
const (
	MinSyncInterval = 10 * time.Millisecond
	MaxSyncInterval = 10 * time.Second
)

// SyncStore is the Redis store in sync mode: each decision is made in
// memory, from this instance's counts and the fleet's as last read (its
// table), and every interval a round sends the counts of the keys touched
// since the last and reads the fleet's back (redis_sync.lua). Windows are
// aligned to the clock. With SyncShare, each instance spends between two
// rounds what the last leased it, sized by its recent demand: see
// docs/redis.md for the bounds this keeps.
//
// It shares with the exact store (RedisStore) the client, the names of the
// keys, health, the listing, unblocks and WebSocket leases (redisCore). The
// zero value is not usable; call NewSyncStore. A SyncStore is safe for
// concurrent use.
type SyncStore struct {
	redisCore
	table *syncTable
	// flyLocal counts the slots of requests in flight taken in this
	// process while Redis failed (on_error local), by cacheKey.
	flyLocal struct {
		mu sync.Mutex
		n  map[string]int
	}
}

// NewSyncStore returns a SyncStore syncing every opts.Sync (which must be
// positive). It does not connect: its first decision starts the sync loop
// (Run), and waits for the first round, up to the store's timeout.
func NewSyncStore(opts RedisStoreOptions) *SyncStore {
	s := &SyncStore{}
	s.init(&opts, s)
	s.table = newSyncTable(opts.Sync, opts.SyncSpend, newInstanceID(), opts.MaxTracked, opts.SyncTimeout)
	return s
}

// Hit decides one request against limit alone: Decide with one check in
// slot 0, of name "".
func (s *SyncStore) Hit(ctx context.Context, key string, now time.Time, limit Limit) (Verdict, error) {
	var out [1]Verdict
	err := s.Decide(ctx, []Check{{Key: key, Limit: limit}}, now, out[:])
	return out[0], err
}

// Configure implements Store: the decisions' timeout (which bounds only
// the wait for the first round), on_error (for WebSocket leases), the
// zone's limits and the bound on the keys the table holds.
func (s *SyncStore) Configure(st Settings) {
	s.configure(st)
	s.table.cap.Store(int64(max(st.MaxTracked, 1)))
}

// Run runs the sync loop, probes Redis whenever the store is degraded,
// sweeps the table and runs the counts CountKeys asks for, until ctx is
// done. interval is not read: the table sweeps itself every
// syncSweepEvery.
func (s *SyncStore) Run(ctx context.Context, _ func() time.Duration) {
	go s.runSync(ctx)
	go s.renewLeases(ctx)
	s.run(ctx, nil)
}

// Len implements Store: the keys the table holds.
func (s *SyncStore) Len() int { return int(s.table.len.Load()) }

// Range implements Store (rangeKeys): the keys counted in their limits'
// running windows (redis_sync.lua), and the banned ones.
func (s *SyncStore) Range(ctx context.Context, now time.Time, fn func(KeyState) bool) error {
	return s.rangeKeys(ctx, now, true, fn)
}

// CutWindows implements Store: windows of another length are other aligned
// windows, whose counts are other hashes in Redis (redis_sync.lua), so the
// next decision starts afresh. Nothing is cut.
func (s *SyncStore) CutWindows(context.Context, Check, time.Time) error { return nil }

// Forget implements Store: it forgets key in every limit of the zone, here
// and in Redis; the other instances hear of it on the unblock channel.
func (s *SyncStore) Forget(ctx context.Context, key string) (bool, error) {
	return forgetEach(ctx, key, s.zoneLimits(), s.ForgetCheck)
}

// ForgetCheck implements Store.
func (s *SyncStore) ForgetCheck(ctx context.Context, c Check) (bool, error) {
	return s.forgetCheck(ctx, c, func(tags []string) { s.forgetSync(c.Name, tags) })
}

// forgetSync drops the named limit's entries of the keys
// whose tags (keys, or their hashes) are tags, with the counts they had not
// sent.
func (s *SyncStore) forgetSync(name string, tags []string) {
	s.table.forget(func(sh *syncShard, e *syncEntry) bool {
		limit, key := sh.slab.parts(e)
		if limit != name {
			return false
		}
		tag := s.tagOf(sh, e, key)
		return slices.ContainsFunc(tags, func(t string) bool { return t == key || t == tag })
	})
}

// probeOnce implements redisOwner: one round of the sync script for the
// probe key, through the client the rounds use.
func (s *SyncStore) probeOnce(ctx context.Context) error {
	ms := s.clock.Now().UnixMilli()
	probe := []syncItem{{key: s.keyOf("", probeTag, "g"), end: (ms/1000 + 1) * 1000, length: 1000, window: 1000,
		prev: -1, max: 1 << 30, weighs: -1}}
	args := s.syncArgs(probe, ms)
	err := s.client.Do(ctx, args...).Err()
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		if err = syncScript.Load(ctx, s.client).Err(); err == nil {
			err = s.client.Do(ctx, args...).Err()
		}
	}
	return err
}

// syncRecord is one instance's record of a key in a window hash of sync
// mode (redis_sync.lua): its id, its count of the window, what it leased
// (its lease and spare share) and until when (Unix ms).
type syncRecord struct {
	id                   string
	count, leased, until int64
}

// syncIDLen is the length of an instance's id (newInstanceID): every
// record of a window hash has an id of that length.
const syncIDLen = 13

// appendRecord appends an instance's record to a field of a window hash:
// the id, then count, leased and until as little-endian 64-bit integers.
func appendRecord(b []byte, id string, count, leased, until int64) []byte {
	b = append(b, id...)
	for _, n := range [...]int64{count, leased, until} {
		b = binary.LittleEndian.AppendUint64(b, uint64(n))
	}
	return b
}

// readRecords reads the records of a field of a window hash whose ids are
// idLen bytes long. A field the module did not write is an error.
func readRecords(v string, idLen int) ([]syncRecord, error) {
	size := idLen + 3*8
	if len(v)%size != 0 {
		return nil, fmt.Errorf("a sync count of %d bytes, not records of %d", len(v), size)
	}
	recs := make([]syncRecord, 0, len(v)/size)
	for p := 0; p < len(v); p += size {
		n := func(k int) int64 { return int64(binary.LittleEndian.Uint64([]byte(v[p+idLen+8*k:]))) }
		recs = append(recs, syncRecord{v[p : p+idLen], n(0), n(1), n(2)})
	}
	return recs, nil
}

// fleetCount returns the fleet's count a field of a window hash holds: the
// sum of its records' counts.
func fleetCount(v string) (int, error) {
	recs, err := readRecords(v, syncIDLen)
	n := 0
	for _, r := range recs {
		n += int(r.count)
	}
	return n, err
}

// recovered implements redisOwner: the running windows' counts go to
// Redis once more.
func (s *SyncStore) recovered() { s.table.resend.Store(true) }

// subscribed implements redisOwner: Redis may have restarted, so the
// counts of the running windows go to it again.
func (s *SyncStore) subscribed(context.Context) { s.table.resend.Store(true) }

// dropCached implements redisOwner: the named limit's entry of the key
// goes, with the counts it had not sent.
func (s *SyncStore) dropCached(name, tag string) { s.forgetSync(name, []string{tag}) }

// Interface guards
var (
	_ Syncer    = (*SyncStore)(nil)
	_ Overrider = (*SyncStore)(nil)
)

// syncShards is how many locks the sync table's keys are spread over.
const syncShards = 64

// syncTable is what a RedisStore in sync mode decides from: for each key of
// each limit touched in its current or previous window, this instance's
// count and the fleet's as last read from Redis. The sync loop (syncRound)
// sends the counts of the keys touched since its last round and reads the
// fleet's back.
type syncTable struct {
	interval time.Duration
	spend    string // SyncShare or SyncAll
	id       string // this instance's id in its records of the window hashes (syncIDLen bytes)

	seed   maphash.Seed
	shards [syncShards]syncShard
	len    atomic.Int64 // keys held
	cap    atomic.Int64 // keys held at most (max_tracked), past one interval's new keys
	// fifo holds the entries in the order they were added, for trim.
	fifoMu sync.Mutex
	fifo   []syncPlace

	fleet  atomic.Int64 // instances that synced recently, this one included
	rank   atomic.Int64 // this one's rank among them by id, from 0
	next   atomic.Int64 // when the next round starts (Unix ns)
	resend atomic.Bool  // the next round sends every key of a running window
	// epoch names the state Redis holds for the zone (a new one after
	// Redis lost it); until learnUntil (Unix ns) after a change, rounds
	// lease no more than the instance's pace and grant no spare share,
	// while every instance reports again what it holds.
	epochMu     sync.Mutex
	epoch       string
	learnUntil  atomic.Int64
	tripTimeout time.Duration // bounds each round trip (sync_timeout)
	bansMu      sync.Mutex
	bans        []Check // violations to record in Redis (Store.Ban)
	stats       syncCounters
	lastOK      atomic.Int64 // when the last round that reached Redis started (Unix ns)
	started     atomic.Int64 // when the sync loop started (Unix ns)
	// ready is closed when the first round has ended, well or not: the
	// decisions before it wait for it (up to the store's timeout), so
	// that an instance joining a fleet knows the fleet before it spends.
	ready    chan struct{}
	setReady func() // closes ready, once
}

// syncCounters are the sync loop's figures, for metrics.
type syncCounters struct {
	roundTrips, batches, keys, dropped atomic.Uint64
}

// SyncStats is what a store in sync mode reports of its rounds.
type SyncStats struct {
	// RoundTrips counts the pipelines sent to Redis.
	RoundTrips uint64
	// Batches counts the script calls they carried, Keys the keys those
	// sent: Keys/Batches is the mean batch.
	Batches, Keys uint64
	// Lag is how old the fleet's counts the decisions use are at most:
	// the time since the last round that reached Redis started.
	Lag time.Duration
	// Dropped counts the counts of windows that never reached Redis: a key
	// evicted, or its window ended, with units Redis had not been sent.
	Dropped uint64
	// Fleet is how many instances synced the zone recently.
	Fleet int
	// Interval and Spend are the store's sync settings.
	Interval time.Duration
	Spend    string
}

// syncShard is one lock's share of the table.
type syncShard struct {
	mu     sync.Mutex
	slab   syncSlab
	dirty  []syncRef // touched since the last round
	leased []syncRef // leased something at the last round
}

// syncEntry is one key of one limit, in its shard's slab: no pointers
// (syncSlab). Times are Unix milliseconds.
type syncEntry struct {
	syncWindow
	num     uint32        // its number in the shard's slab
	gen     atomic.Uint32 // one more each time it leaves the table (syncRef, syncPlace)
	hash    uint32        // the high half of the key's hash (its place in the index)
	ckLen   uint8         // the length of its key (cacheKey) if inline, else syncLongKey
	nameLen uint8         // the length of the limit's name in its key
	shard   uint8         // its shard's number
	live    bool          // in the table
	// ck is its key, cacheKey(name, key), up to syncKeyInline bytes; a
	// longer one is in the slab's map of long keys.
	ck [syncKeyInline]byte
}

// syncWindow is what an entry knows of its key's windows.
type syncWindow struct {
	window int64
	end    int64 // the end of the window counted in mine
	max    int64 // the limit's Max at the last decision
	// mine is what this instance admitted in the window; sent the value of
	// mine that the last round read fleet with (the fleet's count then).
	mine, sent, fleet int64
	// The same for the window before.
	prevMine, prevSent, prevFleet int64
	// With SyncShare, this instance may spend past budgetFrom (mine when
	// the last round started) its lease until leaseUntil (Unix ns) and
	// its spare share. Past leaseUntil the lease keeps only what was
	// spent of it (lapse).
	lease, spare, budgetFrom, leaseUntil int64
	// asked is what the share refused since the last round: demand the
	// next lease covers.
	asked int64
	// held is what the other instances' live leases held at the last
	// round.
	held int64
	// readAt is when the last round that read the window started (Unix
	// ms; 0 before the first).
	readAt   int64
	banUntil int64 // Unix ns
	// rounds is how many rounds have read the window.
	rounds int32
	// refused counts the refusals not yet added to the tally, up to
	// math.MaxInt32 (a key refused that often between two rounds that
	// reach Redis tallies no more).
	refused int32
	cal     calendarRef // the limit's calendar, if its windows follow one
	sliding bool        // the limit's window slides
	// leased is true while the entry is in its shard's leased list.
	leased     bool
	refusedAny bool // a refusal in the window (FirstRefusal)
	bans       bool // the limit bans: a round reads the ban
	dirty      bool
}

// DefaultSyncTimeout returns the bound on each of a sync round's round
// trips for interval when none is set: the interval, and at least a
// second.
func DefaultSyncTimeout(interval time.Duration) time.Duration {
	return max(interval, time.Second)
}

func newSyncTable(interval time.Duration, spend string, id string, maxTracked int, tripTimeout time.Duration) *syncTable {
	if spend == "" {
		spend = SyncShare
	}
	if tripTimeout <= 0 {
		tripTimeout = DefaultSyncTimeout(interval)
	}
	y := &syncTable{interval: interval, spend: spend, id: id, tripTimeout: tripTimeout, seed: maphash.MakeSeed(), ready: make(chan struct{})}
	y.setReady = sync.OnceFunc(func() { close(y.ready) })
	y.cap.Store(int64(maxTracked))
	y.fleet.Store(1)
	return y
}

// hashOf returns the shard of key ck (cacheKey) and its hash in the
// shard's index.
func (y *syncTable) hashOf(ck string) (int, uint32) {
	h := maphash.String(y.seed, ck)
	return int(h % syncShards), uint32(h >> 32)
}

// entry returns the entry of c at ms (creating it), its window rolled to
// the one in progress. The shard (number i; h the key's hash in it) is
// locked.
func (y *syncTable) entry(i int, h uint32, ck string, c *Check, ms int64) *syncEntry {
	sh := &y.shards[i]
	w := c.Limit.Window.Milliseconds()
	e := sh.slab.find(h, ck)
	end := (ms/w + 1) * w // aligned to the epoch, so every instance agrees
	cal := refOf(c.Limit.Calendar)
	if cal != 0 {
		if e != nil && e.cal == cal && ms < e.end {
			end = e.end // the window in progress: no calendar arithmetic per request
		} else {
			end = c.Limit.Calendar.End(ms*int64(time.Millisecond)) / int64(time.Millisecond)
		}
	}
	if e == nil {
		e = sh.slab.add(h, ck)
		e.shard, e.nameLen, e.window, e.end = uint8(i), uint8(len(c.Name)), w, end
		y.fifoMu.Lock()
		y.fifo = append(y.fifo, e.place())
		y.fifoMu.Unlock()
		y.len.Add(1)
		y.prior(e, &c.Limit, ms)
	}
	e.bans, e.max, e.sliding, e.cal = c.Limit.Ban > 0, int64(c.Limit.Max), c.Limit.Sliding(), cal
	switch {
	case e.window != w:
		// A reload changed the window: windows of another length.
		y.drop(e.mine-e.sent, e.prevMine-e.prevSent)
		e.syncWindow = syncWindow{window: w, cal: e.cal, end: end, max: e.max, sliding: e.sliding,
			banUntil: e.banUntil, bans: e.bans, dirty: e.dirty}
		y.prior(e, &c.Limit, ms)
	case end > e.end:
		if end == e.end+e.next(e.end) {
			y.drop(e.prevMine - e.prevSent)
			e.prevMine, e.prevSent, e.prevFleet = e.mine, e.sent, e.fleet
		} else {
			y.drop(e.mine-e.sent, e.prevMine-e.prevSent)
			e.prevMine, e.prevSent, e.prevFleet = 0, 0, 0
		}
		e.end, e.mine, e.sent, e.fleet = end, 0, 0, 0
		e.refusedAny = false
		y.prior(e, &c.Limit, ms)
	}
	return e
}

// drop counts the units of windows that will never reach Redis.
func (y *syncTable) drop(units ...int64) {
	for _, u := range units {
		if u != 0 {
			y.stats.dropped.Add(1)
		}
	}
}

// trim drops the oldest entries until the table holds at most cap, with
// the counts they had not sent (while Redis is away): it runs every
// interval, so the table grows past cap by one interval's new keys at
// most.
func (y *syncTable) trim() {
	for y.len.Load() > y.cap.Load() {
		y.fifoMu.Lock()
		if len(y.fifo) == 0 {
			y.fifoMu.Unlock()
			return
		}
		p := y.fifo[0]
		y.fifo = y.fifo[1:]
		y.fifoMu.Unlock()
		if !y.live(p) {
			continue
		}
		sh := &y.shards[p.shard]
		sh.mu.Lock()
		if e, ok := sh.slab.held(p.syncRef); ok {
			y.drop(e.mine-e.sent, e.prevMine-e.prevSent)
			y.remove(sh, e)
		}
		sh.mu.Unlock()
	}
}

// live reports whether the entry p names is still in the table, without
// its shard's lock: it reads the entry's generation only, atomically, and
// the chunk that holds it is set for good (syncSlab.chunks).
func (y *syncTable) live(p syncPlace) bool {
	return y.shards[p.shard].slab.at(p.num).gen.Load() == p.gen
}

// remove takes e out of its shard: its references go stale.
func (y *syncTable) remove(sh *syncShard, e *syncEntry) {
	sh.slab.remove(e)
	y.len.Add(-1)
}

// prior sets e's budget before a round has read its window: no lease, and
// the spare share of all that the previous window leaves (this instance
// knows nothing yet of what the others spent).
func (y *syncTable) prior(e *syncEntry, l *Limit, ms int64) {
	left := int64(l.Max)
	if l.Sliding() {
		left -= int64(math.Ceil(e.weighs(ms)))
	}
	e.lease, e.leaseUntil, e.budgetFrom, e.asked, e.rounds, e.readAt = 0, 0, 0, 0, 0, 0
	e.spare = y.spareOf(left)
}

// spareOf returns this instance's spare share of free units: all of them
// while it is alone, else half of them divided among the instances that
// synced recently. The shares add up to that half exactly: the first
// instances by id take one more unit each of what does not divide evenly.
// Half, so that instances which joined since the others last spent (and
// know nothing of it) take at most half of what was free between them.
func (y *syncTable) spareOf(free int64) int64 {
	free = max(free, 0)
	n := max(y.fleet.Load(), 1)
	if n == 1 {
		return free
	}
	half := (free + 1) / 2
	spare := half / n
	if y.rank.Load() < half%n {
		spare++
	}
	return spare
}

// prevHeld returns the fleet's count of the window before e's, as this
// instance knows it: the last round's figure and what it admitted since.
func (e *syncEntry) prevHeld() int64 { return e.prevFleet + e.prevMine - e.prevSent }

// weighs returns what the previous window's count weighs at ms in e's
// window when it slides (Limit.sliding).
func (e *syncEntry) weighs(ms int64) float64 {
	l := Limit{Window: time.Duration(e.window) * time.Millisecond, Calendar: e.cal.calendar()}
	return l.sliding(e.prevHeld(), 0, e.end*int64(time.Millisecond), ms*int64(time.Millisecond))
}

// next returns the length of the window after the one ending at end (Unix
// ms): the window, or the calendar's.
func (e *syncEntry) next(end int64) int64 {
	l := Limit{Window: time.Duration(e.window) * time.Millisecond, Calendar: e.cal.calendar()}
	return l.next(end*int64(time.Millisecond)) / int64(time.Millisecond)
}

// length returns the length of the window ending at end (Unix ms).
func (e *syncEntry) length(end int64) int64 {
	l := Limit{Window: time.Duration(e.window) * time.Millisecond, Calendar: e.cal.calendar()}
	return l.length(end*int64(time.Millisecond)) / int64(time.Millisecond)
}

// touch queues e for the next round.
func (sh *syncShard) touch(e *syncEntry) {
	if !e.dirty {
		e.dirty = true
		sh.dirty = append(sh.dirty, e.ref())
	}
}

// Decide implements Store: from the table alone, never waiting on Redis
// once the first round has ended, but for the leases of requests in flight
// (Check.MaxInFlight) an admitting decision takes: see acquireFlying.
func (s *SyncStore) Decide(ctx context.Context, checks []Check, now time.Time, out []Verdict) error {
	if err := s.decideTable(ctx, checks, now, out); err != nil || !s.takeLeases(checks) {
		return err
	}
	return s.acquireFlying(ctx, checks, now, out)
}

// decideTable is Decide from the table. It fails only for more than
// MaxChecks checks.
func (s *SyncStore) decideTable(ctx context.Context, checks []Check, now time.Time, out []Verdict) error {
	n := len(checks)
	if n > MaxChecks || len(out) < n {
		return fmt.Errorf("redis sync store: %d checks for %d verdicts, at most %d", n, len(out), MaxChecks)
	}
	s.markUsed()
	y := s.table
	select {
	case <-y.ready:
	default:
		t := s.clock.NewTimer(time.Duration(s.timeout.Load()))
		select {
		case <-y.ready:
		case <-t.C():
			y.setReady() // the decisions after this one wait no more
		case <-ctx.Done():
		}
		t.Stop()
	}
	t, ms := now.UnixNano(), now.UnixMilli()
	// Lock each shard the checks touch once, in order.
	var idx [MaxChecks]int
	var hs [MaxChecks]uint32
	var cks [MaxChecks]string
	for i := range checks {
		cks[i] = cacheKey(checks[i].Name, checks[i].Key)
		idx[i], hs[i] = y.hashOf(cks[i])
	}
	var order [MaxChecks]int
	locked := order[:copy(order[:], idx[:len(checks)])]
	slices.Sort(locked)
	locked = slices.Compact(locked)
	for _, i := range locked {
		y.shards[i].mu.Lock()
	}
	defer func() {
		for _, i := range locked {
			y.shards[i].mu.Unlock()
		}
	}()
	var es [MaxChecks]*syncEntry
	admit := true
	for i := range checks {
		c := &checks[i]
		e := y.entry(idx[i], hs[i], cks[i], c, ms)
		es[i] = e
		out[i] = y.verdict(e, c, t)
		admit = admit && out[i].Allowed
	}
	for i := range checks {
		c, e := &checks[i], es[i]
		if admit {
			e.mine += c.cost()
			out[i].Remaining = max(out[i].Remaining-int(c.cost()), 0) // what is left after this request, as the other stores say
		} else if !out[i].Allowed {
			if e.refused < math.MaxInt32 {
				e.refused++
			}
			out[i].FirstRefusal = !e.refusedAny
			e.refusedAny = true
		}
		y.shards[idx[i]].touch(e)
	}
	return nil
}

// verdict judges one check against e at t (Unix ns), and starts the ban of
// a violation.
func (y *syncTable) verdict(e *syncEntry, c *Check, t int64) Verdict {
	l := &c.Limit
	cost := c.cost()
	reset := e.end * int64(time.Millisecond)
	cur := e.fleet + e.mine - e.sent
	held := float64(cur)
	prev := e.prevHeld()
	if l.Sliding() {
		held = l.sliding(prev, cur, reset, t)
	}
	v := Verdict{
		Max:       l.Max,
		Remaining: int(max(float64(l.Max)-math.Ceil(held), 0)),
		Reset:     time.Unix(0, reset),
	}
	fits := c.force || held+float64(cost) <= float64(l.Max)
	switch {
	case c.force:
		v.Allowed = true
		return v
	case !fits && l.Sliding():
		v.RetryAfter = max(l.slidingWait(prev, cur, reset, t, cost), time.Millisecond)
	case !fits:
		v.RetryAfter = time.Duration(reset - t)
	case y.spend == SyncShare && e.mine-e.budgetFrom+cost > y.budget(e, t):
		// This instance's share is spent: the next round leases it more
		// if the fleet has it.
		e.asked += cost
		v.RetryAfter = max(time.Duration(y.next.Load()-t), time.Millisecond)
	default:
		v.Allowed = true
	}
	if !fits && cost == 1 && l.Ban > 0 && e.banUntil <= t {
		if c.NoBan {
			v.PendingBan = true
		} else {
			y.startBan(e, c, t)
		}
	}
	if e.banUntil > t {
		v.Allowed = false
		v.Remaining = 0
		v.RetryAfter = max(v.RetryAfter, time.Duration(e.banUntil-t))
		v.Reset = time.Unix(0, t).Add(v.RetryAfter)
	}
	return v
}

// budget returns what e may spend past budgetFrom at t (Unix ns): its
// lease and spare share until they lapse. Past leaseUntil Redis counts
// them no more, and the instance spends, until its next round, a spare
// share of what it last knew free (neither counted nor leased to others),
// as an instance that joins does.
func (y *syncTable) budget(e *syncEntry, t int64) int64 {
	if e.leaseUntil != 0 && t >= e.leaseUntil {
		var weighs int64
		if e.sliding {
			weighs = int64(math.Ceil(e.weighs(t / int64(time.Millisecond))))
		}
		spent := max(e.mine-e.budgetFrom, 0)
		e.lease, e.spare, e.leaseUntil = min(e.lease+e.spare, spent), y.spareOf(e.free(weighs)), 0
	}
	return e.lease + e.spare
}

// free returns what of e's max this instance knows to be neither counted
// (the fleet's count as last read and its own since) nor leased to the
// others, less weighs (a sliding window's previous count).
func (e *syncEntry) free(weighs int64) int64 {
	return e.max - weighs - (e.fleet + e.mine - e.sent) - e.held
}

// startBan bans c's key (of entry e) here at once for the limit's first
// ban, and queues the violation for Redis, which escalates it and spreads
// it to the fleet at the next round.
func (y *syncTable) startBan(e *syncEntry, c *Check, t int64) {
	e.banUntil = t + int64(c.Limit.Ban)
	y.bansMu.Lock()
	y.bans = append(y.bans, Check{Name: c.Name, Key: c.Key, Limit: c.Limit})
	y.bansMu.Unlock()
}

// Refund implements Store: what admitted checks spent (count_status) goes
// back as a lower count of the window they were admitted in, which the
// next round sends. It never fails.
func (s *SyncStore) Refund(_ context.Context, checks []Check, _ time.Time, verdicts []Verdict) error {
	y := s.table
	for i := range checks {
		if i >= len(verdicts) || !verdicts[i].Allowed {
			continue
		}
		c := &checks[i]
		ck := cacheKey(c.Name, c.Key)
		n, h := y.hashOf(ck)
		sh := &y.shards[n]
		sh.mu.Lock()
		if e := sh.slab.find(h, ck); e != nil {
			end := verdicts[i].Reset.UnixMilli()
			switch end {
			case e.end:
				e.mine = max(e.mine-c.cost(), 0)
			case e.end - e.length(e.end):
				e.prevMine = max(e.prevMine-c.cost(), 0)
			}
			sh.touch(e)
		}
		sh.mu.Unlock()
	}
	return nil
}

// Charge implements Store: spent or given back in the table, which the
// next round sends. It never fails.
func (s *SyncStore) Charge(ctx context.Context, checks []Check, now time.Time, verdicts []Verdict) error {
	return charge(ctx, s, checks, now, verdicts)
}

// Ban implements Store: the key is banned here at once and the violation
// goes to Redis at the next round, which spreads the ban to the fleet. It
// never fails.
func (s *SyncStore) Ban(_ context.Context, c Check, now time.Time) (time.Time, error) {
	if c.Limit.Ban <= 0 {
		return time.Time{}, nil
	}
	s.markUsed()
	y := s.table
	ck := cacheKey(c.Name, c.Key)
	i, h := y.hashOf(ck)
	sh := &y.shards[i]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := y.entry(i, h, ck, &c, now.UnixMilli())
	y.startBan(e, &c, now.UnixNano())
	sh.touch(e)
	return time.Unix(0, e.banUntil), nil
}

// forget drops the entries match selects (match is given each entry's
// shard, locked), with the counts they had not sent: an unblocked key
// starts afresh everywhere, and no late count of this instance brings it
// back. Each shard's index shrinks after, if it has far more room than
// entries left.
func (y *syncTable) forget(match func(sh *syncShard, e *syncEntry) bool) {
	for i := range y.shards {
		sh := &y.shards[i]
		sh.mu.Lock()
		sh.slab.each(func(e *syncEntry) bool {
			if match(sh, e) {
				y.remove(sh, e)
			}
			return true
		})
		sh.slab.tidy()
		sh.mu.Unlock()
	}
}

// sweep drops the entries whose windows have both ended and that have
// nothing left to send (a previous count never sent is counted as
// dropped), and the table's record of removed ones.
func (y *syncTable) sweep(ms int64) {
	y.forget(func(_ *syncShard, e *syncEntry) bool {
		if e.end+e.next(e.end) > ms || e.dirty || e.banUntil > ms*int64(time.Millisecond) {
			return false
		}
		y.drop(e.prevMine - e.prevSent)
		return true
	})
	y.fifoMu.Lock()
	y.fifo = slices.DeleteFunc(y.fifo, func(p syncPlace) bool { return !y.live(p) })
	y.fifoMu.Unlock()
}

// SyncStats implements Syncer.
func (s *SyncStore) SyncStats(now time.Time) SyncStats { return s.table.snapshot(now) }

// snapshot returns the sync loop's figures.
func (y *syncTable) snapshot(now time.Time) SyncStats {
	st := SyncStats{
		RoundTrips: y.stats.roundTrips.Load(),
		Batches:    y.stats.batches.Load(),
		Keys:       y.stats.keys.Load(),
		Dropped:    y.stats.dropped.Load(),
		Fleet:      int(y.fleet.Load()),
		Interval:   y.interval,
		Spend:      y.spend,
	}
	if last := y.lastOK.Load(); last != 0 {
		st.Lag = now.Sub(time.Unix(0, last))
	} else if started := y.started.Load(); started != 0 {
		st.Lag = now.Sub(time.Unix(0, started))
	}
	return st
}

// tagOf returns the name in Redis of key, entry e's key: the key itself,
// or its HMAC (hash_keys), which the shard's slab keeps once computed. The
// shard sh is locked.
func (s *SyncStore) tagOf(sh *syncShard, e *syncEntry, key string) string {
	if s.hashKey == nil {
		return key
	}
	if t, ok := sh.slab.tags[e.num]; ok {
		return t
	}
	t := s.tag(key)
	if sh.slab.tags == nil {
		sh.slab.tags = make(map[uint32]string)
	}
	sh.slab.tags[e.num] = t
	return t
}
