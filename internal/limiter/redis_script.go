package limiter

import (
	"context"
	_ "embed"
	"fmt"
	"math"
	"strconv"
	"time"
	"unsafe"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// hitScript is one decision over one or more limits, fixed or sliding: see
// redis.lua. Run sends it by EVALSHA and loads it on NOSCRIPT, so a
// restarted Redis costs one extra round trip.
//
//go:embed redis.lua
var hitSource string

var hitScript = redis.NewScript(hitSource)

// fixedScript decides the common case, one fixed window that does not ban,
// as hitScript would, in about half Redis's time: see redis_fixed.lua.
//
//go:embed redis_fixed.lua
var fixedSource string

var fixedScript = redis.NewScript(fixedSource)

// fixedOne reports whether a decision over checks is fixedScript's case.
func fixedOne(checks []Check) bool {
	if len(checks) != 1 {
		return false
	}
	l := &checks[0].Limit
	return !l.GCRA() && !l.Sliding() && l.Ban == 0 && checks[0].MaxInFlight == 0 && !checks[0].force
}

// releaseScript gives back what admitted requests spent: a Cluster
// decision's reservation in one slot, or a refund (see redis_release.lua).
//
//go:embed redis_release.lua
var releaseSource string

var releaseScript = redis.NewScript(releaseSource)

// keysPerCheck is how many Redis keys a check's decision touches: count,
// refused and previous count, ban and strikes when its limit bans, and the
// leases of its requests in flight when it has a max_in_flight.
func keysPerCheck(c *Check) int {
	n := 3
	if c.Limit.Ban > 0 {
		n += 2
	}
	if c.MaxInFlight > 0 {
		n++
	}
	return n
}

// decisionDeadline is a context with a deadline that the decisions starting
// within one slice of the timeout share.
type decisionDeadline struct {
	ctx     context.Context
	cancel  context.CancelFunc // never called: the deadline releases the context
	timeout int64              // the timeout it was made for
	renew   time.Time          // from then a decision needs a new one (monotonic: a clock step cannot keep an expired one)
}

// deadlineSlices is how many contexts a timeout's span shares out: a
// decision's deadline comes at most a 64th of the timeout early.
const deadlineSlices = 64

// decisionCtx returns the context that bounds a decision starting now by
// the store's timeout. A context and a timer per decision (WithTimeout)
// cost about a tenth of Caddy's time for a Redis decision; decisions
// starting within a 64th of the timeout share one instead. It does not
// carry the request's cancellation: a request cancelled before its
// decision starts is not decided, one cancelled meanwhile is decided all
// the same, by its deadline at the latest. A deadline on the network is
// on the real clock, not the store's.
func (s *RedisStore) decisionCtx() context.Context {
	now, timeout := time.Now(), s.timeout.Load()
	if d := s.deadline.Load(); d != nil && now.Before(d.renew) && d.timeout == timeout {
		return d.ctx
	}
	d := &decisionDeadline{timeout: timeout, renew: now.Add(time.Duration(timeout / deadlineSlices))}
	d.ctx, d.cancel = context.WithDeadline(context.Background(), now.Add(time.Duration(timeout)))
	s.deadline.Store(d)
	return d.ctx
}

// decideRedis runs the decision script for the checks: once, or on a
// Cluster once per slot they span (see Decide).
func (s *RedisStore) decideRedis(ctx context.Context, checks []Check, now time.Time, out []Verdict) error {
	if err := ctx.Err(); err != nil {
		return err // the client is gone: no decision to make
	}
	ctx = s.decisionCtx()
	if fixedOne(checks) {
		var buf [8]int64 // the reply, off the heap
		res, err := s.runCmd(ctx, fixedScript, s.fixedCmd(&checks[0], now), buf[:0])
		if err != nil {
			return err
		}
		return s.verdicts(checks, res, now, out)
	}
	var at [MaxChecks + 1]int // check i's keys are keys[at[i]:at[i+1]]
	for i := range checks {
		at[i+1] = at[i] + keysPerCheck(&checks[i])
	}
	// Sized to the checks: the keys escape to the heap with the call.
	keys := make([]string, at[len(checks)])
	for i := range checks {
		c := &checks[i]
		base := s.base(c.Name, s.tag(c.Key))
		k := keys[at[i]:]
		k[0], k[1], k[2] = base+"c", base+"r", base+"p"
		if c.Limit.Ban > 0 {
			k[3], k[4] = base+"b", base+"s"
		}
		if c.MaxInFlight > 0 {
			k[keysPerCheck(c)-1] = base + "f"
		}
	}
	_, cluster := s.client.(*redis.ClusterClient)
	if !cluster || len(checks) == 1 {
		return s.runDecision(ctx, checks, keys, now, out)
	}
	// Group the checks by slot, in the order their slots first appear.
	var slotOf [MaxChecks]uint16
	for i := range checks {
		slotOf[i] = clusterSlot(keys[at[i]])
	}
	done := make([]bool, len(checks))
	var reserved [][]int // the checks of each slot that admitted
	admitted := true
	for i := range checks {
		if done[i] {
			continue
		}
		var idx []int
		for j := i; j < len(checks); j++ {
			if !done[j] && slotOf[j] == slotOf[i] {
				idx = append(idx, j)
				done[j] = true
			}
		}
		group := make([]Check, len(idx))
		gkeys := make([]string, 0, 5*len(idx))
		for k, j := range idx {
			group[k] = checks[j]
			gkeys = append(gkeys, keys[at[j]:at[j+1]]...)
		}
		gout := make([]Verdict, len(idx))
		if err := s.runDecision(ctx, group, gkeys, now, gout); err != nil {
			s.release(ctx, checks, reserved, nil, now)
			return err
		}
		slotAdmits := true
		for k, j := range idx {
			out[j] = gout[k]
			slotAdmits = slotAdmits && gout[k].Allowed
		}
		if !slotAdmits {
			// The request is refused. The other slots are still asked,
			// so that every limit that refuses tallies it and the
			// verdicts (and headers) are exact.
			admitted = false
			continue
		}
		reserved = append(reserved, idx)
	}
	if admitted {
		return nil
	}
	s.release(ctx, checks, reserved, nil, now)
	var leased []Check // the leases the admitting slots took
	for _, idx := range reserved {
		for _, j := range idx {
			if checks[j].Lease != "" {
				leased = append(leased, checks[j])
			}
		}
	}
	if len(leased) > 0 {
		go s.dropLeases(leased)
	}
	for i := range checks {
		c := &checks[i]
		if out[i].Allowed {
			out[i].Remaining = min(out[i].Remaining+int(c.cost()), c.Limit.Max) // its reservation was given back
		}
	}
	return nil
}

// release gives back what the checks of each group spent (each group's
// keys share a slot). verdicts, when given, are the checks' admitted
// verdicts: a GCRA bucket then gets back only what has not dripped back by
// now (gcraBack); without them, all of it (a reservation given back at
// once). It runs even when the decision's own deadline has passed (a slow
// slot is why a decision fails), with a deadline of its own. A failure is
// logged: the counts then stand until their windows end.
func (s *RedisStore) release(ctx context.Context, checks []Check, groups [][]int, verdicts []Verdict, now time.Time) {
	if len(groups) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.slowTimeout())
	defer cancel()
	for _, idx := range groups {
		keys := make([]string, 0, len(idx))
		args := make([]any, 0, 2*len(idx))
		for _, j := range idx {
			c := &checks[j]
			keys = append(keys, s.base(c.Name, s.tag(c.Key))+"c")
			if !c.Limit.GCRA() {
				args = append(args, c.cost(), 0)
				continue
			}
			back := c.cost() * c.Limit.interval()
			if verdicts != nil {
				back = gcraBack(c, verdicts[j], now)
			}
			args = append(args, 0, max(back/int64(time.Microsecond), 1))
		}
		if err := releaseScript.Run(ctx, s.client, keys, args...).Err(); err != nil {
			s.logger.Warn("giving back a request's counts", zap.Strings("keys", keys), zap.Error(err))
		}
	}
}

// gcraBack returns what a GCRA request admitted with verdict v still holds
// of its bucket at now: its cost in time, less what has dripped back since
// (the bucket it left behind empties at v.Reset).
func gcraBack(c *Check, v Verdict, now time.Time) int64 {
	return min(c.cost()*c.Limit.interval(), max(int64(v.Reset.Sub(now)), 0))
}

// runDecision runs the decision script once for checks, whose keys (those
// keysPerCheck counts for each, in order) share one slot.
func (s *RedisStore) runDecision(ctx context.Context, checks []Check, keys []string, now time.Time, out []Verdict) error {
	// Sized to the checks: the arguments escape to the heap with the call.
	args := make([]any, 8*len(checks))
	for i := range checks {
		c := &checks[i]
		mode, burst := 0, int64(0)
		window, cutoff := c.Limit.windowArgs(now)
		switch {
		case c.Limit.GCRA():
			mode, burst = 2, c.Limit.burst()
		case c.Limit.Sliding() && c.Limit.Calendar != nil:
			// The window after this one, what is left of this one, and
			// its length: see redis.lua.
			end := c.Limit.Calendar.End(now.UnixNano())
			mode, window, burst = 3, c.Limit.next(end)/int64(time.Millisecond), c.Limit.length(end)/int64(time.Millisecond)
		case c.Limit.Sliding():
			mode = 1
		}
		a := args[8*i : 8*i+8]
		a[0], a[1], a[2], a[3] = c.Limit.Max, window, cutoff, mode
		if c.force {
			a[0] = forcedMax
		}
		a[4], a[5], a[6] = c.cost(), burst, ""
		if c.Limit.Ban > 0 {
			noBan := ":0"
			if c.NoBan {
				noBan = ":1"
			}
			a[6] = strconv.FormatInt(c.Limit.Ban.Milliseconds(), 10) + ":" + strconv.FormatInt(c.Limit.BanMax.Milliseconds(), 10) + noBan
		}
		a[7] = ""
		if c.MaxInFlight > 0 {
			a[7] = strconv.Itoa(c.MaxInFlight) + ":" + strconv.FormatInt(s.leaseTTL().Milliseconds(), 10) + ":" + c.Lease
		}
	}
	res, err := s.runScript(ctx, hitScript, keys, args)
	if err != nil {
		return err
	}
	return s.verdicts(checks, res, now, out)
}

// verdicts reads the checks' verdicts from a decision script's results, 7
// per check (see redis.lua).
func (s *RedisStore) verdicts(checks []Check, res []int64, now time.Time, out []Verdict) error {
	if len(res) != 8*len(checks) {
		return fmt.Errorf("redis store: decision script returned %d values, want %d", len(res), 8*len(checks))
	}
	t := now.UnixNano()
	// A bucket's times count from when Redis ran the script, after now:
	// from the reply, they are late rather than early, so that a refund
	// (gcraBack) never leaves a sliver of the request behind.
	replied := s.clock.Now()
	for i := range checks {
		c := &checks[i]
		r := res[8*i : 8*i+8]
		left := time.Duration(r[2]) * time.Millisecond
		if c.Limit.Calendar != nil {
			// The key expires at the calendar's boundary, give or take
			// the milliseconds the round trip took: it ends there.
			left = min(left, time.Duration(c.Limit.Calendar.End(now.UnixNano())-now.UnixNano()))
		}
		v := Verdict{
			Allowed:   r[0] == 1 && r[6] <= 0 && r[7] >= 0,
			Max:       c.Limit.Max,
			Remaining: int(max(int64(c.Limit.Max)-r[1], 0)),
			Reset:     now.Add(left),
		}
		reset := t + int64(left)
		switch {
		case c.Limit.GCRA():
			v.Remaining = int(max(c.Limit.burst()-r[1], 0))
			v.Reset = replied.Add(left)
		case c.Limit.Sliding():
			v.Remaining = int(max(float64(c.Limit.Max)-math.Ceil(c.Limit.sliding(r[4], r[1], reset, t)), 0))
		}
		if r[0] == 0 {
			v.RetryAfter = left
			switch {
			case r[5] > 0:
				v.RetryAfter = max(time.Duration(r[5])*time.Millisecond, time.Millisecond)
			case c.Limit.Sliding():
				v.RetryAfter = max(c.Limit.slidingWait(r[4], r[1], reset, t, c.cost()), time.Millisecond)
			}
		}
		if r[7] < 0 && r[0] == 1 && r[6] <= 0 {
			// Refused for the key's requests in flight alone.
			v.InFlightFull, v.RetryAfter = true, time.Second
		}
		if !v.Allowed {
			v.FirstRefusal = r[3] == 1
			v.PendingBan = r[6] < 0
		}
		if r[6] > 0 {
			// Refused until the ban ends, and the window admits.
			v.RetryAfter = max(v.RetryAfter, time.Duration(r[6])*time.Millisecond)
			v.Remaining = 0
			v.Reset = now.Add(v.RetryAfter)
		}
		out[i] = v
	}
	return nil
}

// pipelineQueue bounds the decisions queued in the auto-pipeliner: past
// it, a decision fails at once (and on_error decides it).
const pipelineQueue = 10_000

// runScript runs a script with keys and args, through the auto-pipeliner
// when the store has one.
func (s *RedisStore) runScript(ctx context.Context, script *redis.Script, keys []string, args []any) ([]int64, error) {
	full := make([]any, 0, 3+len(keys)+len(args))
	full = append(full, "evalsha", script.Hash(), len(keys))
	for _, k := range keys {
		full = append(full, k)
	}
	return s.runCmd(ctx, script, append(full, args...), nil)
}

// fixedHash is fixedScript's SHA1, boxed once for every command.
var fixedHash any = fixedScript.Hash()

// fixedCmd returns the EVALSHA command of fixedScript for check c at now.
// It allocates what it must: the two keys in one string, and the arguments
// with the keys' headers, which the arguments hold as *string (go-redis
// writes them, and finds a Cluster slot from them, as strings) so that they
// are not boxed one by one. The limit's max and window are boxed once per
// limit.
func (s *RedisStore) fixedCmd(c *Check, now time.Time) []any {
	tag := s.tag(c.Key)
	k := make([]byte, 0, 2*(baseLen(s.prefix, c.Name, tag)+1))
	k = append(s.appendBase(k, c.Name, tag), 'c')
	n := len(k)
	// The refused key: the same base again.
	k = append(append(k, k[:n-1]...), 'r')
	keys := unsafe.String(unsafe.SliceData(k), len(k)) // k is not written again
	b := s.boxedLimit(&c.Limit)
	window, cutoff := b.windowAny, b.windowAny
	if c.Limit.Calendar != nil {
		w, _ := c.Limit.windowArgs(now) // what is left of the calendar window
		window, cutoff = w, w
	} else if ms := c.Limit.cutoffIn(now).Milliseconds(); ms != b.window {
		cutoff = ms // a reload shortened the window
	}
	a := new(fixedArgs)
	a.keys = [2]string{keys[:n], keys[n:]}
	a.args = [...]any{"evalsha", fixedHash, 2, &a.keys[0], &a.keys[1], b.maxAny, window, cutoff, c.cost()}
	return a.args[:]
}

// fixedArgs is fixedCmd's command in one allocation: its arguments, and the
// two keys they point to.
type fixedArgs struct {
	args [9]any
	keys [2]string
}

// boxedLimit is a limit's max and window in milliseconds, boxed as script
// arguments.
type boxedLimit struct {
	max, window       int64
	maxAny, windowAny any
}

// boxedLimit returns l's max and window boxed: the last limit's, kept,
// when l is the same.
func (s *RedisStore) boxedLimit(l *Limit) *boxedLimit {
	w := l.Window.Milliseconds()
	if b := s.boxed.Load(); b != nil && b.max == int64(l.Max) && b.window == w {
		return b
	}
	b := &boxedLimit{max: int64(l.Max), window: w, maxAny: int64(l.Max), windowAny: w}
	s.boxed.Store(b)
	return b
}

// runCmd runs script's EVALSHA command full ("evalsha", its hash, the
// number of keys, the keys, the arguments), through the auto-pipeliner
// when the store has one; when Redis lacks the script (NOSCRIPT, after a
// restart) it loads it and sends the command again. The script's integers
// are appended to into[:0].
func (s *RedisStore) runCmd(ctx context.Context, script *redis.Script, full []any, into []int64) ([]int64, error) {
	cmd, err := s.send(ctx, full)
	// HasErrorPrefix allocates even for nil: it is asked only on an error.
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
		if err = script.Load(ctx, s.client).Err(); err == nil {
			cmd, err = s.send(ctx, full)
		}
	}
	if err != nil {
		return nil, err
	}
	return appendInts(into[:0], cmd)
}

// appendInts appends a script's reply, a list of integers, to into.
func appendInts(into []int64, cmd *redis.Cmd) ([]int64, error) {
	vals, err := cmd.Slice()
	if err != nil {
		return nil, err
	}
	for _, v := range vals {
		n, ok := v.(int64)
		if !ok {
			return nil, fmt.Errorf("redis store: script reply holds %T, not an integer", v)
		}
		into = append(into, n)
	}
	return into, nil
}

// send sends the command full, its first key at index 3, through the
// auto-pipeliner when the store has one.
func (s *RedisStore) send(ctx context.Context, full []any) (*redis.Cmd, error) {
	cmd := redis.NewCmd(ctx, full...)
	cmd.SetFirstKeyPos(3) // the first key, for a Cluster's slot
	if s.pipe == nil {
		return cmd, s.client.Process(ctx, cmd)
	}
	if err := ctx.Err(); err != nil {
		return nil, err // once queued, the command would run all the same
	}
	return cmd, s.pipe.Submit(ctx, cmd).WaitContext(ctx)
}
