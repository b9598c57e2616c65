package limiter

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// syncScript writes an instance's counts of the keys it touched and reads
// the fleet's back: see redis_sync.lua.
//
//go:embed redis_sync.lua
var syncSource string

var syncScript = redis.NewScript(syncSource)

// fleetScript records that an instance synced now and returns how many
// did within the horizon, the instance's rank among them by id, and the
// zone's epoch: a member scored +inf that the first roll call after Redis
// lost the set (a restart, a failover to an empty replica) writes anew
// (KEYS[1] the zone's sorted set of instances; ARGV: now in ms, the
// instance's id, the horizon in ms, an epoch to write if there is none).
var fleetScript = redis.NewScript(`
local epoch = redis.call('ZRANGEBYSCORE', KEYS[1], '+inf', '+inf')[1]
if not epoch then
	epoch = '~' .. ARGV[4]
	redis.call('ZADD', KEYS[1], '+inf', epoch)
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[3]))
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[3]))
local rank = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(+inf')) do
	if id < ARGV[2] then
		rank = rank + 1
	end
end
return {redis.call('ZCARD', KEYS[1]) - 1, rank, epoch}
`)

const (
	// syncBatch is how many keys one script call carries at most.
	syncBatch = 200
	// syncTrip is how many keys one round trip (a pipeline of batches)
	// carries at most: a round with more makes several, each within the
	// sync timeout.
	syncTrip = 10 * syncBatch
	// syncFleetRounds is how many intervals an instance counts in the
	// fleet after its last round.
	syncFleetRounds = 3
	// syncSweepEvery is how often the table drops the keys whose windows
	// have ended.
	syncSweepEvery = time.Second
)

// syncItem is one key's part of a round: what it sends, and the entry that
// takes what it reads.
type syncItem struct {
	at  syncPlace // the entry, named past its shard's lock
	key string    // the key's field in the window hashes (…:g)
	// end names the window mine counts, length is its length, and window
	// the length of the one after it (its hash of counts outlives it by
	// that: redis_sync.lua); prevLength is the length of the window before;
	// prev is the count of the window before (-1: not sent); refused the
	// refusals to tally.
	end, length, window, prevLength, mine, prev, refused int64
	bans                                                 bool
	// max is the limit's; want the units to lease; pace the most while
	// learning (twice what was spent since the last round, at least 2
	// after a refusal); weighs what a sliding window's previous count
	// weighs now, in whole units (-1 for a fixed window).
	max, want, pace, weighs int64
	// known is true when a round wrote this instance's count of the
	// window before; waiting for the instance's first two rounds of it.
	known, waiting bool
	// knownFleet and held are the fleet's count of the window and the
	// others' leases as the instance knew them when the round started.
	knownFleet, held int64
}

// runSync runs the sync loop until ctx ends: a round every interval while
// Redis is not DEGRADED (the health probe brings it back), and a sweep of
// the table every second. Nothing connects before the store is used.
func (s *SyncStore) runSync(ctx context.Context) {
	y := s.table
	select {
	case <-ctx.Done():
		return
	case <-s.used:
	}
	y.started.Store(s.clock.Now().UnixNano())
	tick := s.clock.NewTicker(y.interval)
	defer tick.Stop()
	swept := s.clock.Now()
	for {
		s.syncTick(ctx, s.clock.Now())
		if now := s.clock.Now(); now.Sub(swept) >= syncSweepEvery {
			y.sweep(now.UnixMilli())
			swept = now
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C():
		}
	}
}

// syncTick is one turn of the sync loop at start: a round unless the store
// is DEGRADED, after which the decisions waiting for the first round go on.
func (s *SyncStore) syncTick(ctx context.Context, start time.Time) {
	y := s.table
	y.next.Store(start.Add(y.interval).UnixNano())
	y.trim()
	if s.state.Load() != stateDegraded {
		s.syncRound(ctx, start)
	}
	y.setReady()
}

// syncRound sends the counts of every key touched since the last round and
// takes the fleet's back, in round trips of at most syncTrip keys, each
// collected just before it is sent, so a round holds one trip's items at a
// time however many keys it sends. What a round trip fails to send (a
// batch, a ban) is left to the next round (the counts are absolute:
// sending them twice counts nothing twice), and the failure counts against
// the store's health. One round runs at a time (the sync loop's): a round
// keeps its place in the shards' touched lists between its trips.
func (s *SyncStore) syncRound(ctx context.Context, start time.Time) {
	y := s.table
	y.trim()
	cur := syncCursor{ms: start.UnixMilli(), all: y.resend.Swap(false)}
	bans := y.takeBans()
	buf := make([]syncItem, 0, syncTrip)
	for first := true; first || !cur.done(); first = false {
		trip := y.collect(s, &cur, buf)
		unsent, unbanned, err := s.syncTrip(ctx, trip, bans, start, false)
		if err != nil {
			y.requeue(unsent)
			if cur.all {
				y.resend.Store(true) // the shards not collected yet resend at the next round
			}
			y.bansMu.Lock()
			y.bans = append(unbanned, y.bans...)
			y.bansMu.Unlock()
			if ctx.Err() == nil {
				s.failed(err)
				s.logger.Debug("redis sync round", zap.Error(err))
			}
			return
		}
		if first {
			y.lastOK.Store(start.UnixNano())
		}
		bans = nil
		s.succeeded()
	}
}

// syncTrip is one round trip: the fleet's roll call and the round's bans
// with the first (bans not nil), then the keys' batches (one per Cluster
// slot on a Cluster). It returns what it did not send, and the first
// error; loaded is true once it has loaded the scripts again.
func (s *SyncStore) syncTrip(ctx context.Context, items []syncItem, bans []Check, start time.Time, loaded bool) (unsent []syncItem, unbanned []Check, err error) {
	y := s.table
	tctx, cancel := context.WithTimeout(ctx, y.tripTimeout)
	defer cancel()
	ms := start.UnixMilli()
	pipe := s.client.Pipeline()
	horizon := int64(syncFleetRounds) * max(y.interval.Milliseconds(), 1)
	fleet := fleetScript.EvalSha(tctx, pipe, []string{s.prefix + "fleet"}, ms, y.id, horizon, newInstanceID())
	banCmds := make([]*redis.Cmd, len(bans))
	for i, c := range bans {
		base := s.base(c.Name, s.tag(c.Key))
		banCmds[i] = banScript.EvalSha(tctx, pipe, []string{base + "b", base + "s", base + "r"},
			c.Limit.Ban.Milliseconds(), c.Limit.BanMax.Milliseconds())
	}
	batches := y.batches(s, items)
	cmds := make([]*redis.StringCmd, len(batches))
	for i, b := range batches {
		cmds[i] = s.syncCmd(tctx, pipe, b, ms)
	}
	_, err = pipe.Exec(tctx)
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") && !loaded {
		// Redis lost its scripts (a restart): load them and send again,
		// which writes the same counts, and send every running window's
		// counts at the next round.
		y.resend.Store(true)
		for _, sc := range []*redis.Script{fleetScript, banScript, syncScript} {
			if err := sc.Load(tctx, s.client).Err(); err != nil {
				return items, bans, err
			}
		}
		return s.syncTrip(ctx, items, bans, start, true)
	}
	y.stats.roundTrips.Add(1)
	// Each command has its own outcome: what Redis did is taken, the
	// rest goes to the next round.
	if r, err := fleet.Slice(); err == nil && len(r) == 3 {
		n, _ := r[0].(int64)
		rank, _ := r[1].(int64)
		epoch, _ := r[2].(string)
		y.fleet.Store(max(n, 1))
		y.rank.Store(rank)
		y.sawEpoch(epoch, start)
	}
	for i, cmd := range banCmds {
		if b, err := cmd.Int64(); err == nil {
			y.banned(&bans[i], start, b)
		} else {
			unbanned = append(unbanned, bans[i])
		}
	}
	for i, b := range batches {
		res, cerr := cmds[i].Result()
		if cerr == nil && len(res) != syncReplySize*len(b) {
			cerr = fmt.Errorf("redis sync script: %d bytes of replies for %d keys, want %d each", len(res), len(b), syncReplySize)
		}
		if cerr != nil {
			unsent = append(unsent, b...)
			if err == nil {
				err = cerr
			}
			continue
		}
		y.stats.batches.Add(1)
		y.stats.keys.Add(uint64(len(b)))
		for j := range b {
			y.apply(&b[j], readReplies(res[syncReplySize*j:]), start)
		}
	}
	if err != nil && errors.Is(err, redis.Nil) {
		err = nil
	}
	return unsent, unbanned, err
}

// syncReplySize is how many bytes of the sync script's reply one key
// takes: 6 little-endian 64-bit integers (redis_sync.lua packs them with
// struct.pack('<i8i8i8i8i8i8')).
const syncReplySize = 6 * 8

// syncReplies is one key's replies of the sync script.
type syncReplies struct {
	total, prevTotal, ban, lease, spare, held int64
}

// readReplies reads the key's replies at the start of r.
func readReplies(r string) syncReplies {
	var v [6]int64
	for i := range v {
		v[i] = int64(binary.LittleEndian.Uint64([]byte(r[8*i : 8*i+8])))
	}
	return syncReplies{v[0], v[1], v[2], v[3], v[4], v[5]}
}

// syncCmd queues the script call of one batch on pipe (syncArgs). Its
// reply is one string, the keys' replies packed (readReplies).
func (s *SyncStore) syncCmd(ctx context.Context, pipe redis.Pipeliner, b []syncItem, ms int64) *redis.StringCmd {
	cmd := redis.NewStringCmd(ctx, s.syncArgs(b, ms)...)
	_ = pipe.Process(ctx, cmd) // a pipeline only queues: Exec reports
	return cmd
}

// syncArgs returns the EVALSHA command of one batch of the sync script at
// ms: each key's field, every key's numbers in one argument (appendNums),
// which the script unpacks without parsing text, and the window hashes
// the batch reads and writes, with their expiries (see redis_sync.lua).
func (s *SyncStore) syncArgs(b []syncItem, ms int64) []any {
	y := s.table
	args := make([]any, 0, 3+len(b)+12)
	args = append(args, "evalsha", syncScript.Hash(), len(b))
	for i := range b {
		args = append(args, &b[i].key) // a pointer boxes without an allocation
	}
	args = append(args, ms, y.id, ms+y.leaseFor().Milliseconds(), flag(y.spend == SyncShare),
		y.fleet.Load(), y.rank.Load(), flag(y.learning(ms)))
	var tag string
	if len(b) > 0 {
		tag = s.windowTag(b[0].key) // a batch's keys share a slot
	}
	// The window hashes, numbered from 1 in the order the keys name
	// them: a batch names one or two, or a few more when its limits'
	// windows differ.
	type window struct{ end, length int64 }
	var hashes []any
	numbers := make(map[window]uint16, 2)
	number := func(end, length, next int64) uint16 {
		w := window{end, length}
		if n, ok := numbers[w]; ok {
			return n
		}
		hashes = append(hashes, s.windowKey(tag, end, length), end+next)
		numbers[w] = uint16(len(numbers) + 1)
		return numbers[w]
	}
	nums := make([]byte, 0, syncNumsSize*len(b))
	for i := range b {
		it := &b[i]
		h, ph := number(it.end, it.length, it.window), uint16(0)
		if it.prev >= 0 || it.weighs >= 0 {
			ph = number(it.end-it.length, it.prevLength, it.length)
		}
		nums = it.appendNums(nums, h, ph)
	}
	args = append(args, nums)
	return append(args, hashes...)
}

// syncNumsSize is how many bytes of the script's last argument one key
// takes: 9 little-endian 64-bit integers, a byte of flags and two
// little-endian 16-bit integers, the layout redis_sync.lua unpacks with
// struct.unpack('<i8i8i8i8i8i8i8i8i8BHH').
const syncNumsSize = 9*8 + 1 + 2*2

// The bits of a key's flags byte.
const (
	syncFlagBans    = 1 << iota // read the ban
	syncFlagKnown               // a round wrote the window before
	syncFlagWaiting             // the instance's first two rounds of the window
)

// appendNums appends the item's numbers to the script's numbers argument:
// h and ph are the numbers of its window's hash and the previous window's
// (0: none) among the batch's (syncArgs).
func (it *syncItem) appendNums(b []byte, h, ph uint16) []byte {
	for _, n := range [...]int64{it.end, it.window, it.mine, it.prev, it.refused, it.max, it.want, it.pace, it.weighs} {
		b = binary.LittleEndian.AppendUint64(b, uint64(n))
	}
	var f byte
	if it.bans {
		f |= syncFlagBans
	}
	if it.known {
		f |= syncFlagKnown
	}
	if it.waiting {
		f |= syncFlagWaiting
	}
	b = append(b, f)
	b = binary.LittleEndian.AppendUint16(b, h)
	return binary.LittleEndian.AppendUint16(b, ph)
}

// flag is a script's boolean argument.
func flag(b bool) int {
	if b {
		return 1
	}
	return 0
}

// batches splits a round trip's items into script calls: on a Cluster, one
// or more per slot, since a script's keys must share one.
func (y *syncTable) batches(s *SyncStore, items []syncItem) [][]syncItem {
	var out [][]syncItem
	if _, cluster := s.client.(*redis.ClusterClient); !cluster {
		for len(items) > 0 {
			n := min(len(items), syncBatch)
			out = append(out, items[:n])
			items = items[n:]
		}
		return out
	}
	bySlot := make(map[uint16]int) // slot → index in out of its open batch
	for _, it := range items {
		slot := clusterSlot(it.key)
		i, ok := bySlot[slot]
		if !ok || len(out[i]) >= syncBatch {
			i = len(out)
			bySlot[slot] = i
			out = append(out, nil)
		}
		out[i] = append(out[i], it)
	}
	return out
}

// syncCursor is where a round has got to in the table: the shard it
// collects from next, and how many of that shard's keys are still the
// round's.
type syncCursor struct {
	ms    int64 // the round's start, in Unix ms
	all   bool  // every running window's count is sent (Redis came back)
	shard int
	// open is true once the shard's leases and (all) its running windows
	// are taken; left is how many of its touched keys the round still
	// sends then: those touched since go to the next round, so that no
	// key is sent twice in one round (a round counts towards a window's
	// first two, see syncItem.waiting).
	open bool
	left int
}

// done reports whether the round has collected every shard.
func (c *syncCursor) done() bool { return c.shard == syncShards }

// collect takes, into buf, up to cap(buf) of the keys touched since the
// last round (every key of a running window after Redis came back) from
// where cur is, and what each sends: its counts, and with SyncShare the
// lease it asks for, twice what it spent and was refused for want of a
// share since the last round (while learning, twice what it spent: its
// pace).
func (y *syncTable) collect(s *SyncStore, cur *syncCursor, buf []syncItem) []syncItem {
	ms, items := cur.ms, buf[:0]
	for ; !cur.done() && len(items) < cap(items); cur.shard++ {
		sh := &y.shards[cur.shard]
		sh.mu.Lock()
		if !cur.open {
			y.open(sh, ms, cur.all)
			cur.open, cur.left = true, len(sh.dirty)
		}
		n := min(cur.left, cap(items)-len(items))
		for _, r := range sh.dirty[:n] {
			e, ok := sh.slab.held(r)
			if !ok {
				continue // its memory may hold another key, with a reference of its own
			}
			e.dirty = false
			items = append(items, y.itemOf(s, sh, e, cur.shard, ms, cur.all))
		}
		rest := copy(sh.dirty, sh.dirty[n:])
		clear(sh.dirty[rest:])
		sh.dirty = sh.dirty[:rest]
		sh.mu.Unlock()
		if cur.left -= n; cur.left > 0 {
			return items // the rest of this shard goes in the next trip
		}
		cur.open = false
	}
	return items
}

// open readies shard sh for a round at ms: every running window's key is
// touched when all, and a lease is renewed while the instance spends, and
// given back (it asks for nothing) at the first round after it stopped,
// when the fleet may need it: once half of max is counted or leased (its
// own spare share, half of what is free at most, aside). Below that, every
// instance's spare share covers its own demand, and the lease lapses by
// itself. The shard is locked.
func (y *syncTable) open(sh *syncShard, ms int64, all bool) {
	if all {
		// Every count Redis may read again: the running window's, the
		// one before it, and the one that just ended (its entry rolls at
		// its next request).
		sh.slab.each(func(e *syncEntry) bool {
			if e.end+e.next(e.end) > ms || e.prevMine != e.prevSent {
				sh.touch(e)
			}
			return true
		})
	}
	for _, r := range sh.leased {
		e, ok := sh.slab.held(r)
		if !ok {
			continue
		}
		e.leased = false
		if e.end > ms && 2*(e.fleet+e.held+e.lease) >= e.max {
			sh.touch(e)
		}
	}
	clear(sh.leased)
	sh.leased = sh.leased[:0]
}

// itemOf returns what entry e of shard sh (number i) sends in a round at
// ms. The shard is locked.
func (y *syncTable) itemOf(s *SyncStore, sh *syncShard, e *syncEntry, i int, ms int64, all bool) syncItem {
	name, key := sh.slab.parts(e)
	it := syncItem{
		at: e.place(), key: s.keyOf(name, s.tagOf(sh, e, key), "g"),
		end: e.end, length: e.window, window: e.window, prevLength: e.window, mine: e.mine, prev: -1,
		refused: int64(e.refused), bans: e.bans,
		max: e.max, known: e.rounds > 0, waiting: e.rounds < 2,
		knownFleet: e.fleet + e.mine - e.sent, held: e.held,
	}
	if y.spend == SyncShare && e.end > ms {
		spent := max(e.mine-e.budgetFrom, 0)
		it.want = 2 * (spent + e.asked)
		it.pace = 2 * max(spent, min(e.asked, 1))
	}
	e.asked = 0
	if e.cal != 0 {
		it.length, it.window = e.length(e.end), e.next(e.end)
		it.prevLength = e.length(e.end - it.length)
	}
	it.weighs = -1 // a fixed window: the previous count is not read
	if e.sliding {
		it.weighs = int64(math.Ceil(e.weighs(ms)))
	}
	if e.prevMine != e.prevSent || all && e.prevMine > 0 {
		it.prev = e.prevMine
	}
	e.refused = 0
	return it
}

// requeue gives the items of a failed round trip back to the next round.
func (y *syncTable) requeue(items []syncItem) {
	for i := range items {
		it := &items[i]
		sh := &y.shards[it.at.shard]
		sh.mu.Lock()
		if e, ok := sh.slab.held(it.at.syncRef); ok {
			e.refused = int32(min(int64(e.refused)+it.refused, math.MaxInt32))
			sh.touch(e)
		}
		sh.mu.Unlock()
	}
}

// apply takes what a round read of one key: the fleet's counts, its ban
// and what the round reserved this instance.
func (y *syncTable) apply(it *syncItem, r syncReplies, start time.Time) {
	sh := &y.shards[it.at.shard]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e, ok := sh.slab.held(it.at.syncRef)
	if !ok {
		return
	}
	total, prevTotal, ban, lease, spare, held := r.total, r.prevTotal, r.ban, r.lease, r.spare, r.held
	if ban > 0 {
		e.banUntil = max(e.banUntil, start.Add(time.Duration(ban)*time.Millisecond).UnixNano())
	}
	if total < 0 {
		// Redis had left the window behind: its counts are dropped.
		y.drop(it.mine - e.sentOf(it.end))
		if it.prev >= 0 {
			y.drop(it.prev - e.prevSent)
		}
		return
	}
	switch e.end {
	case it.end:
		lastBudget, lastFrom, lastRead := e.lease+e.spare, e.budgetFrom, e.readAt
		e.sent, e.fleet = it.mine, total
		e.rounds++
		e.readAt = start.UnixMilli()
		if it.prev >= 0 {
			e.prevSent = it.prev
		}
		e.prevFleet = prevTotal
		// What the round leased this instance, and its spare share,
		// from what it had admitted when the round started. Without
		// either, an instance that asked nothing (it gave its lease
		// back) spends as if its lease had lapsed; one that asked and
		// was granted nothing spends nothing until a round grants it
		// more: what it knows free may be held for instances Redis has
		// not counted yet (redis_sync.lua).
		e.lease, e.spare, e.held, e.budgetFrom = lease, spare, held, it.mine
		if y.learning(start.UnixMilli()) {
			// Redis may not hold the others' counts and leases again
			// yet: the highest count and leases known stand. At the instance's first round of the
			// key in learning (the others have not reported again, and
			// the round that found the restart was granted as if Redis
			// held them) it keeps what its last lease and spare share
			// left, as Doorman's clients keep what they hold, and is
			// granted nothing new. After that, the lease is no more
			// than what the known figures leave, and the instance
			// takes no more of the spare share Redis holds for it
			// than is left after that, as a joiner does, once its
			// first two rounds of the window are over (until then
			// Redis holds that much for instances it has not counted
			// yet: redis_sync.lua). A spare share Redis does not hold
			// would be leased to the others again.
			e.fleet, e.held = max(total, it.knownFleet), max(held, it.held)
			learnStart := y.learnUntil.Load()/int64(time.Millisecond) - y.leaseFor().Milliseconds()
			if lastRead < learnStart {
				e.lease, e.spare = max(lastBudget-(it.mine-lastFrom), 0), 0
			} else {
				e.lease = min(lease, max(e.max-max(it.weighs, 0)-e.fleet-e.held, 0))
				e.spare = 0
				if !it.waiting {
					e.spare = min(spare, y.spareOf(e.free(max(it.weighs, 0))-e.lease))
				}
			}
		}
		e.leaseUntil = start.UnixNano()
		if lease+spare > 0 || it.want > 0 {
			e.leaseUntil = start.Add(y.leaseFor()).UnixNano()
			if !e.leased {
				e.leased = true
				sh.leased = append(sh.leased, e.ref())
			}
		}
	case it.end + it.window:
		// The key's window rolled while the round was away: what it read
		// is now the previous window's.
		e.prevSent, e.prevFleet = it.mine, total
	}
}

// sentOf returns what e's window ending at end had sent.
func (e *syncEntry) sentOf(end int64) int64 {
	if end == e.end {
		return e.sent
	}
	return e.prevSent
}

// takeBans takes the violations queued since the last round.
func (y *syncTable) takeBans() []Check {
	y.bansMu.Lock()
	defer y.bansMu.Unlock()
	b := y.bans
	y.bans = nil
	return b
}

// banned records the ban Redis set for a violation (ms milliseconds from
// start).
func (y *syncTable) banned(c *Check, start time.Time, ms int64) {
	ck := cacheKey(c.Name, c.Key)
	i, h := y.hashOf(ck)
	sh := &y.shards[i]
	sh.mu.Lock()
	if e := sh.slab.find(h, ck); e != nil {
		e.banUntil = start.Add(time.Duration(ms) * time.Millisecond).UnixNano()
	}
	sh.mu.Unlock()
}

// leaseFor is how long a lease lasts: two intervals and a round trip, so
// that the round after next renews it before it lapses, and it lapses
// within that time once the instance stops asking.
func (y *syncTable) leaseFor() time.Duration {
	return 2*y.interval + y.tripTimeout
}

// learning reports whether at ms (Unix ms: a round's script and what it
// reads back judge by the same millisecond) the instance is still learning
// what the fleet holds after Redis lost its state.
func (y *syncTable) learning(ms int64) bool { return ms*int64(time.Millisecond) < y.learnUntil.Load() }

// sawEpoch takes the zone's epoch from a roll call at start: when it
// changed, Redis lost what it held of the zone, so the next round sends
// every running window's count again, and for a lease's length no round
// leases more than the instance's pace (twice what it spent since its
// last round) or grants a spare share, while the other instances report
// again what they hold.
func (y *syncTable) sawEpoch(epoch string, start time.Time) {
	y.epochMu.Lock()
	defer y.epochMu.Unlock()
	if y.epoch != "" && epoch != y.epoch {
		y.resend.Store(true)
		y.learnUntil.Store(start.Add(y.leaseFor()).UnixNano())
	}
	y.epoch = epoch
}

// newInstanceID returns an id for this instance's counts in Redis, unique
// among the instances sharing a zone.
func newInstanceID() string { return rand.Text()[:13] }
