package limiter

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
)

// The fleet simulator: sync-mode stores (the real code, each on its own
// fake clock and its own client) against one in-process Redis that runs the
// real scripts on the simulated clock, driven by a seeded random schedule,
// with the bounds of docs/redis.md checked as each window ends.
const (
	simSync   = 100 * time.Millisecond
	simWindow = 2 * time.Second
	// simTrip is the sync timeout: a lease lives 2·simSync + simTrip.
	simTrip = 200 * time.Millisecond
	// simStep is the simulated clock's resolution.
	simStep = time.Millisecond
	// simSkew bounds how far an instance's clock is off the simulation's.
	simSkew = 10 * time.Millisecond
	// simEpisode is how many windows one fleet lives: each episode starts
	// a fleet anew, with its own spend, size and limits.
	simEpisode = 10
	// simMaxInstances bounds the instances alive at once.
	simMaxInstances = 6
	// simDefaultWindows is the length of a run without SIM_WINDOWS.
	simDefaultWindows = 300
)

// simAllowance is how long after a key's traffic moves the instance it
// reaches may refuse it while the fleet is under quota: two intervals and a
// sync round trip, and an interval more when the instance it left died
// (docs/redis.md, "When the client moves").
const simAllowance = 2*simSync + simTrip

// simLearning is how long after a Redis fault ends an instance may refuse
// a key under quota: until its probe finds Redis again, then a lease's
// length of learning after the epoch change it sees at its next round, and
// that round's interval.
const simLearning = defaultProbeEvery + simSync + (2*simSync + simTrip) + simSync

// simInstance is one Caddy instance of the simulated fleet.
type simInstance struct {
	n      int // its number in the episode
	s      *SyncStore
	clk    *clock.Fake
	client *redis.Client
	skew   time.Duration
	// nextRound, nextSweep and nextProbe are simulated times.
	nextRound, nextSweep, nextProbe time.Duration
	// routed is true while the balancer sends it requests; syncing while
	// it runs its sync loop (a drained instance syncs on a while).
	routed, syncing bool
	// stopAt is when a leaving instance stops (0: never).
	stopAt time.Duration
	// lastReq is the simulated time of its last request, by key, and
	// stint when it last started serving the key after a pause longer
	// than simAllowance; lastOK the simulated time of its last round that
	// reached Redis.
	lastReq, stint map[string]time.Duration
	lastOK         time.Duration
	// counted holds the instances Redis counted in the fleet at its last
	// round that reached it (by their numbers).
	counted map[int]bool
	// idle holds the keys it served whose demand a round of it found
	// none of since the round before: their lease lapses or goes back,
	// and its next request spends unannounced again.
	idle map[string]bool
	// okRounds counts its rounds that reached Redis; joined is when it
	// started.
	okRounds int
	joined   time.Duration
	// reported counts its rounds that reached Redis since Redis last
	// restarted empty, up to 2.
	reported int
}

// simKeyWindow is what the fleet did with one key in one window.
type simKeyWindow struct {
	key      string
	end      int64 // the window's end, Unix ms
	max      int
	kind     string // light, bursty, surge or hammer
	balancer string
	admitted int
	// byInst is what each instance admitted; first its first request's
	// time, and firstRounds its rounds that reached Redis by then.
	byInst      map[int]int
	first       map[int]time.Duration
	firstRounds map[int]int
	// terms are the joiners' unannounced spends the share bound allows
	// (docs/redis.md): one per instance that first sees the key after
	// another's second sync in the window, or again after a pause.
	terms []int
	// rate is the most requests per second sent for the key.
	rate float64
	// unsent is what each instance admitted since its last round; lost
	// what the fleet can never learn of, and may admit again: what
	// instances that stopped had not sent, and what they had when a
	// restart emptied Redis (lostBy, by instance).
	unsent, lostBy map[int]int
	lost           int
	// counted is, for each instance serving the key, the instances its
	// last round before its first request of the window counted in the
	// fleet, and fleetAt how many; joiner marks the instances counted as
	// joiners on their first sight of the key.
	counted map[int]map[int]bool
	fleetAt map[int]int
	joiner  map[int]bool
}

// simFault is a Redis fault: an outage from at to until, a restart
// (emptied) at at, or from at to until a Redis so slow that a sync round
// trip takes trip, longer than the interval (each instance's rounds then
// come trip apart).
type simFault struct {
	at, until time.Duration
	restart   bool
	trip      time.Duration
}

// down reports whether f is an outage under way at t.
func (f simFault) down(t time.Duration) bool {
	return !f.restart && f.trip == 0 && f.at <= t && t < f.until
}

// simArrival is one request of a key's schedule; checked when a refusal
// of it while the fleet is under quota breaks docs/redis.md's promise.
type simArrival struct {
	at      time.Duration
	checked bool
}

// simKey is one key's schedule in the window in progress.
type simKey struct {
	name     string
	kind     string // idle, light, bursty, surge or hammer
	balancer string // sticky, round robin, moving, spreading or random
	arrivals []simArrival
	// killAt is when the instance a surge went to is killed (0: none).
	killAt time.Duration
	sticky int // the instance a sticky or moving key goes to
	moveAt time.Duration
	// movedAt is when the key's traffic last moved (a move, a new
	// window's balancer), and killedAt when the instance it went to was
	// last killed.
	movedAt, killedAt time.Duration
	rr                int
	rate              float64
}

// simRun is one simulation.
type simRun struct {
	t     *testing.T
	seed  uint64
	rng   *rand.Rand
	mini  *miniredis.Miniredis
	base  time.Time // simulated time 0, aligned to a window
	now   time.Duration
	ep    int
	spend string
	// contended: most windows hammer the keys, and instances join and
	// leave twice as often.
	contended bool
	max       map[string]int
	insts     []*simInstance
	keys      []*simKey
	kws       map[string]*simKeyWindow // by key and window end
	// checks are the key-windows' checks, by the time they fall due.
	checks []simCheck
	faults []simFault
	down   bool     // Redis answers errors (an outage)
	events []string // the episode's schedule, for a failure's report
	traced string   // SIM_TRACE: <episode>:<key> to trace
	ctx    context.Context

	// Totals for the last line.
	windows, keyWindows, joins, nFaults int
	worst                               float64 // highest admitted/max
	worstAdmit, worstBound, worstMax    int
	wrongful, burstRefused              int
	checkedEqual, uncheckedEqual        int
	failures                            *atomic.Int64 // the run's, over its workers
}

// simCheck is the check of a key-window due at at (simulated time).
type simCheck struct {
	at time.Duration
	kw *simKeyWindow
}

// TestFleetSimulation runs sync-mode fleets through seeded random schedules
// (balancers, instances joining and leaving mid-window, Redis outages and
// restarts, clock skew, both spends) and checks at every window's end that
// each key's admitted count is within the bound docs/redis.md states for
// the layout, that no key under quota is refused outside the stated
// allowance, that Redis holds what the fleet admitted, and that no
// instance keeps a key longer than its windows need. SIM_SEED replays a
// run; SIM_WINDOWS sets its length.
func TestFleetSimulation(t *testing.T) {
	// Without SIM_SEED, one seed: the default run (CI's) is the same
	// every time, and a new seed is a long run's to try.
	seed := uint64(1)
	if v := os.Getenv("SIM_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("SIM_SEED %q: %v", v, err)
		}
		seed = n
	}
	windows := simDefaultWindows
	if v := os.Getenv("SIM_WINDOWS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("SIM_WINDOWS %q: want a positive number of windows", v)
		}
		windows = n
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)
	traced := os.Getenv("SIM_TRACE")
	first, last := 1, (windows+simEpisode-1)/simEpisode // episodes
	if traced != "" {
		// The traced episode alone: each draws from its own generator.
		ep, _, ok := strings.Cut(traced, ":")
		n, err := strconv.Atoi(ep)
		if !ok || err != nil || n < 1 {
			t.Fatalf("SIM_TRACE %q: want <episode>:<key>, as a failure prints it", traced)
		}
		first, last, windows = n, n, min(windows, simEpisode)
	}
	t.Logf("SIM_SEED=%d SIM_WINDOWS=%d", seed, windows)
	// The episodes are dealt to a worker per core, each with a Redis of
	// its own: an episode replays alone, so the run's outcome is the same
	// on any number of cores.
	var failures, done atomic.Int64
	runs := make([]*simRun, min(runtime.GOMAXPROCS(0), last-first+1))
	var wg sync.WaitGroup
	for w := range runs {
		mini := miniredis.NewMiniRedis()
		if err := mini.Start(); err != nil {
			t.Fatal(err)
		}
		defer mini.Close()
		mini.ClockTTL(true)
		r := &simRun{t: t, seed: seed, mini: mini, base: start, ctx: ctx, traced: traced, failures: &failures}
		runs[w] = r
		wg.Go(func() {
			for ep := first + w; ep <= last && failures.Load() < 5; ep += len(runs) {
				n := min(simEpisode, windows-(ep-first)*simEpisode)
				r.episode(ep, n)
				if d := done.Add(int64(n)); d/10000 != (d-int64(n))/10000 {
					t.Logf("%d of %d windows, %d failures", d, windows, failures.Load()) // a long run's progress (-v)
				}
			}
		})
	}
	wg.Wait()
	r := runs[0]
	for _, o := range runs[1:] {
		r.add(o)
	}
	line := fmt.Sprintf("simulated %d windows, %d key-windows, %d joins, %d faults: max overshoot %.2f× max (bound %.2f×), wrongful refusals %d (and %d of bursty keys under quota); Redis checked against the fleet in %d key-windows (%d skipped: a fault or a stopped instance)",
		r.windows, r.keyWindows, r.joins, r.nFaults, float64(r.worstAdmit)/float64(max(r.worstMax, 1)), float64(r.worstBound)/float64(max(r.worstMax, 1)), r.wrongful, r.burstRefused, r.checkedEqual, r.uncheckedEqual)
	if failures.Load() > 0 {
		line += fmt.Sprintf(" (SIM_SEED=%d replays it)", seed)
	}
	fmt.Fprintln(os.Stderr, line)
}

// add adds o's totals to r's.
func (r *simRun) add(o *simRun) {
	r.windows += o.windows
	r.keyWindows += o.keyWindows
	r.joins += o.joins
	r.nFaults += o.nFaults
	r.wrongful += o.wrongful
	r.burstRefused += o.burstRefused
	r.checkedEqual += o.checkedEqual
	r.uncheckedEqual += o.uncheckedEqual
	r.worseOf(o.worst, o.worstAdmit, o.worstBound, o.worstMax)
}

// worseOf keeps an overshoot of admitted of max (bound the bound then) as
// the run's worst if it is higher than the worst so far, or as high with
// a tighter bound.
func (r *simRun) worseOf(over float64, admitted, bound, max_ int) {
	if over > r.worst || over == r.worst && bound < r.worstBound*max_/max(r.worstMax, 1) {
		r.worst, r.worstAdmit, r.worstBound, r.worstMax = over, admitted, bound, max_
	}
}

// fail reports one broken invariant with what replays it.
func (r *simRun) fail(format string, args ...any) {
	r.t.Helper()
	if r.failures.Add(1) > 5 {
		return
	}
	r.t.Errorf("SIM_SEED=%d, episode %d (spend %s), at %v: %s\nthe episode's schedule:\n\t%s\nSIM_SEED=%d SIM_TRACE=%d:<key> replays the episode alone, tracing the key",
		r.seed, r.ep, r.spend, r.now, fmt.Sprintf(format, args...), strings.Join(r.events, "\n\t"), r.seed, r.ep)
}

// logf records one event of the episode's schedule.
func (r *simRun) logf(format string, args ...any) {
	r.events = append(r.events, fmt.Sprintf("%v ", r.now)+fmt.Sprintf(format, args...))
}

// episode runs fleet number ep through windows windows.
func (r *simRun) episode(ep, windows int) {
	r.ep = ep
	// Its own generator, and a start fixed by its number (an episode
	// ends within a window of its last): one episode replays alone.
	r.rng = rand.New(rand.NewPCG(r.seed, uint64(r.ep)))
	r.now = time.Duration(r.ep) * (simEpisode + 1) * simWindow
	r.mini.SetTime(r.base.Add(r.now))
	r.events = nil
	r.spend = SyncShare
	if r.rng.IntN(3) == 0 {
		r.spend = SyncAll
	}
	// A contended episode hammers its keys in most windows, and its
	// fleet changes more often: joiners and reservations under load.
	r.contended = r.rng.IntN(3) == 0
	r.insts = nil
	r.kws = make(map[string]*simKeyWindow)
	r.checks, r.faults = nil, nil
	r.mini.SetError("")
	r.down = false
	r.max = map[string]int{}
	r.keys = nil
	for i := range 2 {
		name := fmt.Sprintf("k%d", i)
		r.max[name] = []int{10, 20, 50, 100}[r.rng.IntN(4)]
		r.keys = append(r.keys, &simKey{name: name})
	}
	r.logf("episode %d: spend %s, max k0 %d, k1 %d, contended %v", r.ep, r.spend, r.max["k0"], r.max["k1"], r.contended)
	for range 1 + r.rng.IntN(4) {
		r.join()
	}
	for range windows {
		r.window()
	}
	// The last window's checks.
	end := r.now + 4*simSync + 2*simSkew
	for r.now < end {
		r.step()
	}
	for _, in := range r.insts {
		in.client.Close()
	}
}

// join starts an instance now: its first round runs at once, as the sync
// loop's does, and the balancer sends it requests from then on.
func (r *simRun) join() {
	in := &simInstance{n: len(r.insts), lastReq: map[string]time.Duration{}, stint: map[string]time.Duration{}, idle: map[string]bool{}, routed: true, syncing: true, joined: r.now, reported: 2}
	in.skew = time.Duration(r.rng.Int64N(int64(2*simSkew+1))) - simSkew
	in.clk = clock.NewFake(r.base.Add(r.now + in.skew))
	in.client = redis.NewClient(&redis.Options{Addr: r.mini.Addr(), MaxRetries: -1, DialTimeout: time.Second})
	in.s = NewSyncStore(RedisStoreOptions{
		Client: in.client, Prefix: fmt.Sprintf("sim:%d:", r.ep), Sync: simSync, SyncSpend: r.spend,
		SyncTimeout: simTrip, Timeout: time.Second, Clock: in.clk,
	})
	// An id from the seed: the instances' order by id (their ranks)
	// splits what does not divide evenly, so a replay needs the same.
	in.s.table.id = fmt.Sprintf("%013x", r.rng.Uint64()>>12)
	in.s.markUsed()
	r.insts = append(r.insts, in)
	r.joins++
	r.logf("instance %d joins (clock %+v)", in.n, in.skew)
	in.nextSweep = r.now + syncSweepEvery
	r.roundOf(in)
}

// live returns the instances the balancer may send a request to.
func (r *simRun) live() []*simInstance {
	var out []*simInstance
	for _, in := range r.insts {
		if in.routed {
			out = append(out, in)
		}
	}
	return out
}

// window plans one window's schedule and runs it.
func (r *simRun) window() {
	start := r.now
	r.windows++
	for _, k := range r.keys {
		k.plan(r, start)
	}
	// Instances joining and leaving, and Redis faults, at random times
	// in the window.
	type event struct {
		at time.Duration
		do func()
	}
	var evs []event
	odds := 1
	if r.contended {
		odds = 2
	}
	if len(r.live()) < simMaxInstances && r.rng.IntN(4) < odds {
		evs = append(evs, event{start + r.randIn(simWindow), r.join})
	}
	if r.rng.IntN(5) < odds {
		evs = append(evs, event{start + r.randIn(simWindow), r.leave})
	}
	if r.rng.IntN(8) == 0 {
		f := simFault{at: start + r.randIn(simWindow)}
		switch r.rng.IntN(3) {
		case 0:
			f.restart = true
		case 1:
			f.until = f.at + 50*time.Millisecond + r.randIn(750*time.Millisecond)
		default:
			// Slower than the interval, within the sync timeout.
			f.until = f.at + r.randIn(simWindow)
			f.trip = simSync + 10*time.Millisecond + r.randIn(simTrip-simSync-20*time.Millisecond)
		}
		r.faults = append(r.faults, f)
		r.nFaults++
		evs = append(evs, event{f.at, func() { r.fault(f) }})
	}
	slices.SortFunc(evs, func(a, b event) int { return int(a.at - b.at) })
	for r.now < start+simWindow {
		for len(evs) > 0 && evs[0].at <= r.now {
			evs[0].do()
			evs = evs[1:]
		}
		r.step()
	}
}

// randIn returns a random duration in [0, d), in whole steps.
func (r *simRun) randIn(d time.Duration) time.Duration {
	return time.Duration(r.rng.Int64N(int64(d/simStep))) * simStep
}

// leave drains an instance: the balancer sends it nothing from now on, and
// it stops (its sync loop with it) now or within three intervals, without
// giving anything back, as a killed process does.
func (r *simRun) leave() {
	live := r.live()
	if len(live) < 2 {
		return
	}
	in := live[r.rng.IntN(len(live))]
	in.routed = false
	in.stopAt = r.now + r.randIn(3*simSync)
	r.logf("instance %d drained, stops at %v", in.n, in.stopAt)
}

// kill stops the instance a surge of k went to, at once and without
// giving back what it holds, and moves k on, if another instance can take
// it.
func (r *simRun) kill(k *simKey) {
	live := r.live()
	if len(live) < 2 {
		return
	}
	for _, in := range live {
		if in.n == k.sticky {
			in.routed, in.stopAt = false, r.now
			r.logf("instance %d killed", in.n)
			// Every key whose traffic it served moves on.
			for _, o := range r.keys {
				if o.sticky == in.n {
					o.killedAt = r.now
				}
			}
		}
	}
}

// fault starts a Redis fault.
func (r *simRun) fault(f simFault) {
	if f.restart {
		// A restart ends an outage under way: Redis is back, empty.
		for i := range r.faults {
			if g := &r.faults[i]; g.down(r.now) {
				g.until = r.now
			}
		}
		r.mini.SetError("")
		r.down = false
		r.mini.FlushAll()
		for _, in := range r.insts {
			in.reported = 0
		}
		for _, kw := range r.kws {
			for _, in := range r.insts {
				if !in.syncing {
					kw.lost += kw.byInst[in.n] - kw.lostBy[in.n]
					kw.lostBy[in.n] = kw.byInst[in.n]
				}
			}
		}
		if err := redis.NewClient(&redis.Options{Addr: r.mini.Addr()}).ScriptFlush(r.ctx).Err(); err != nil {
			r.t.Fatal(err)
		}
		r.logf("Redis restarts empty")
		return
	}
	if f.trip > 0 {
		r.logf("Redis slow until %v: a round trip takes %v", f.until, f.trip)
		return
	}
	r.mini.SetError("LOADING simulated outage")
	r.down = true
	r.logf("Redis down until %v", f.until)
}

// plan draws the key's schedule for the window starting at start.
func (k *simKey) plan(r *simRun, start time.Duration) {
	max := r.max[k.name]
	k.arrivals = k.arrivals[:0]
	k.kind = []string{"idle", "light", "light", "bursty", "surge", "hammer"}[r.rng.IntN(6)]
	if r.contended && r.rng.IntN(3) != 0 {
		k.kind = "hammer"
	}
	k.balancer = []string{"sticky", "round robin", "moving", "spreading", "random"}[r.rng.IntN(5)]
	k.moveAt, k.killAt, k.movedAt = start+r.randIn(simWindow), 0, start
	if r.rng.IntN(2) == 0 {
		// Early, while the instances serving the key have their first
		// rounds of the window.
		k.moveAt = start + r.randIn(3*simSync)
	}
	if live := r.live(); len(live) > 0 {
		k.sticky = live[r.rng.IntN(len(live))].n
	}
	n := 0
	switch k.kind {
	case "light":
		// A steady pace, under quota (at most half of max): checked.
		n = 1 + r.rng.IntN(max/2)
		k.steady(r, start, start+simWindow, n)
	case "bursty":
		// Under quota too, at random times: a burst may outrun what
		// the instance's last round leased it and its spare share.
		n = 1 + r.rng.IntN(max/2)
		k.random(r, start, start+simWindow, n, false)
	case "surge":
		// Half of max at once through one instance, which is killed
		// with its lease held; the client moves on at a steady pace,
		// under quota, and is checked from then on.
		k.balancer = "moving"
		at := start + r.randIn(simWindow/4)
		k.random(r, at, at+150*time.Millisecond, max/2, false)
		k.moveAt, k.killAt = at+150*time.Millisecond, at+150*time.Millisecond
		k.steady(r, k.moveAt, start+simWindow, max*3/10)
		n = len(k.arrivals)
	case "hammer":
		n = []int{3, 12}[r.rng.IntN(2)] * max
		k.random(r, start, start+simWindow, n, false)
	}
	slices.SortFunc(k.arrivals, func(a, b simArrival) int { return int(a.at - b.at) })
	k.rate = float64(n) / simWindow.Seconds()
	if n > 0 {
		r.logf("%s: %s, %d requests, %s", k.name, k.kind, n, k.balancer)
	}
}

// steady adds n arrivals evenly spaced over [from, to), each up to a
// quarter of the spacing early or late, whose refusals are checked.
func (k *simKey) steady(r *simRun, from, to time.Duration, n int) {
	if n <= 0 {
		return
	}
	gap := (to - from) / time.Duration(n)
	for i := range n {
		at := from + time.Duration(i)*gap + gap/4 + r.randIn(gap/2+simStep)
		k.arrivals = append(k.arrivals, simArrival{at: at.Truncate(simStep), checked: true})
	}
}

// random adds n arrivals at random times in [from, to).
func (k *simKey) random(r *simRun, from, to time.Duration, n int, checked bool) {
	for range n {
		k.arrivals = append(k.arrivals, simArrival{at: from + r.randIn(to-from), checked: checked})
	}
}

// route picks the instance for the key's request now, or nil.
func (k *simKey) route(r *simRun) *simInstance {
	live := r.live()
	if len(live) == 0 {
		return nil
	}
	switch k.balancer {
	case "spreading":
		// Sticky, then round robin from moveAt on: instances start
		// serving a key another is already spending.
		if r.now < k.moveAt {
			break
		}
		fallthrough
	case "round robin":
		k.rr++
		return live[k.rr%len(live)]
	case "random":
		return live[r.rng.IntN(len(live))]
	case "moving":
		if r.now >= k.moveAt {
			k.moveAt, k.movedAt = math.MaxInt64, r.now
			k.sticky = live[r.rng.IntN(len(live))].n
			r.logf("%s moves to instance %d", k.name, k.sticky)
		}
	}
	for _, in := range live {
		if in.n == k.sticky {
			return in
		}
	}
	in := live[r.rng.IntN(len(live))] // its instance left: the balancer moves it
	k.sticky, k.movedAt = in.n, r.now
	return in
}

// step runs what falls due in one step of the simulated clock, and moves
// it on.
func (r *simRun) step() {
	r.mini.SetTime(r.base.Add(r.now))
	down := false
	for _, f := range r.faults {
		down = down || f.down(r.now)
	}
	if r.down && !down {
		r.mini.SetError("")
		r.logf("Redis back")
	}
	r.down = down
	for _, in := range r.insts {
		if !in.syncing {
			continue
		}
		in.clk.Set(r.base.Add(r.now + in.skew))
		if in.stopAt != 0 && r.now >= in.stopAt {
			in.syncing = false
			r.logf("instance %d stops", in.n)
			for _, kw := range r.kws {
				if in.reported < 2 {
					// Redis restarted empty after its last resend
					// (the round after the one that saw the epoch
					// turn): all it admitted is lost.
					kw.lost += kw.byInst[in.n] - kw.lostBy[in.n]
					kw.lostBy[in.n] = kw.byInst[in.n]
					continue
				}
				kw.lost += kw.unsent[in.n]
				kw.lostBy[in.n] += kw.unsent[in.n]
			}
			continue
		}
		if r.now >= in.nextRound {
			r.roundOf(in)
		}
		if in.s.state.Load() == stateDegraded && r.now >= in.nextProbe {
			in.s.probeStep(r.ctx)
			in.nextProbe = r.now + in.s.probeEvery
		}
		if r.now >= in.nextSweep {
			in.s.table.sweep(in.clk.Now().UnixMilli())
			in.nextSweep = r.now + syncSweepEvery
			r.checkMemory(in)
		}
	}
	for _, k := range r.keys {
		if k.killAt != 0 && r.now >= k.killAt {
			k.killAt = 0
			r.kill(k)
		}
		for len(k.arrivals) > 0 && k.arrivals[0].at <= r.now {
			a := k.arrivals[0]
			k.arrivals = k.arrivals[1:]
			if in := k.route(r); in != nil {
				r.request(in, k, a.checked)
			}
		}
	}
	for len(r.checks) > 0 && r.checks[0].at <= r.now {
		r.check(r.checks[0].kw)
		r.checks = r.checks[1:]
	}
	r.now += simStep
}

// roundOf runs one turn of in's sync loop, and counts the round toward the
// key-windows it touched when it reached Redis.
func (r *simRun) roundOf(in *simInstance) {
	before, degraded := in.s.table.lastOK.Load(), in.s.state.Load() == stateDegraded
	in.s.syncTick(r.ctx, in.clk.Now())
	in.nextRound = r.now + simSync
	for _, f := range r.faults {
		if f.trip > 0 && f.at <= r.now && r.now < f.until {
			in.nextRound = r.now + f.trip
		}
	}
	for _, k := range r.keys {
		r.trace(in, k.name, "round")
	}
	switch {
	case in.s.table.lastOK.Load() != before:
		for k, last := range in.lastReq {
			if last < in.lastOK {
				in.idle[k] = true
			}
		}
		in.lastOK = r.now
		in.counted = r.fleetMembers()
		in.okRounds++
		in.reported = min(in.reported+1, 2)
		for _, kw := range r.kws {
			delete(kw.unsent, in.n)
		}
	case !r.down && !degraded:
		// A round trip over the sync timeout on a busy host: a fault
		// the schedule did not plan, which relaxes the checks of its
		// windows as a planned one does.
		r.faults = append(r.faults, simFault{at: r.now, until: r.now + simSync})
		r.logf("instance %d: its round failed on this host", in.n)
	}
}

// fleetMembers returns the instances the zone's fleet in Redis counts now
// (by their numbers): the instances whose last round is within the
// horizon, as the last round's fleet script left them.
func (r *simRun) fleetMembers() map[int]bool {
	ids, err := r.mini.ZMembers(fmt.Sprintf("sim:%d:fleet", r.ep))
	if err != nil {
		r.fail("reading the fleet: %v", err)
	}
	out := map[int]bool{}
	for _, in := range r.insts {
		if slices.Contains(ids, in.s.table.id) {
			out[in.n] = true
		}
	}
	return out
}

// request sends one request of k to in, and records its verdict.
func (r *simRun) request(in *simInstance, k *simKey, checked bool) {
	limit := Limit{Window: simWindow, Max: r.max[k.name]}
	at := in.clk.Now()
	v, err := in.s.Hit(r.ctx, k.name, at, limit)
	if err != nil {
		r.fail("instance %d: %v", in.n, err)
		return
	}
	kw := r.keyWindow(k, v.Reset.UnixMilli())
	last, seen := in.lastReq[k.name]
	in.lastReq[k.name] = r.now
	if !seen || r.now-last > simAllowance {
		in.stint[k.name] = r.now
	}
	if _, ok := kw.first[in.n]; !ok || in.idle[k.name] {
		delete(in.idle, k.name)
		// The instance (re)starts serving the key: a joiner, unless no
		// other instance has had its second round of the window yet.
		n := int(in.s.table.fleet.Load())
		if !ok {
			kw.first[in.n] = r.now
			kw.firstRounds[in.n] = in.okRounds
			kw.counted[in.n], kw.fleetAt[in.n] = in.counted, n
			// The instances already serving the key that this one
			// did not count in the fleet: each spent unannounced
			// beside what this one takes for all it knows.
			for _, o := range r.insts {
				if _, serves := kw.first[o.n]; serves && o != in && !kw.joiner[o.n] && !kw.counted[in.n][o.n] {
					kw.joiner[o.n] = true
					kw.terms = append(kw.terms, shareTerm(kw.max, kw.fleetAt[o.n]))
				}
			}
		}
		if r.joinedLate(kw, in) && (ok || !kw.joiner[in.n]) {
			kw.joiner[in.n] = true
			kw.terms = append(kw.terms, shareTerm(kw.max, n))
		}
	}
	if in.s.state.Load() == stateDegraded && !kw.joiner[in.n] {
		// A DEGRADED instance does not sync: past its lease it spends a
		// spare share of what it last knew free, unannounced, as a
		// joiner does, until its probe finds Redis again.
		kw.joiner[in.n] = true
		kw.terms = append(kw.terms, shareTerm(kw.max, int(in.s.table.fleet.Load())))
	}
	kw.rate = max(kw.rate, k.rate)
	r.trace(in, k.name, fmt.Sprintf("%s allowed=%v", kw.key, v.Allowed))
	if v.Allowed {
		kw.admitted++
		kw.byInst[in.n]++
		kw.unsent[in.n]++
		return
	}
	if !checked {
		if k.kind == "bursty" {
			// Under quota too, but a burst may outrun what the
			// instance's last round leased it (twice its demand of the
			// interval before) and its spare share: refused until its
			// next round, as docs/redis.md says. Counted, not failed.
			r.burstRefused++
		}
		return
	}
	// A key under quota: refused only near it, within the allowance after
	// its traffic reached the instance, or while the fleet learns again
	// after a Redis fault.
	n := int(in.s.table.fleet.Load())
	stint := in.stint[k.name]
	switch {
	case kw.admitted+1+2*n > kw.max:
	case r.now-max(stint, k.movedAt) <= simAllowance:
	case r.now-k.killedAt <= simAllowance+simSync:
	case r.faultWithin(r.now-simLearning, r.now):
	default:
		r.wrongful++
		r.fail("%s refused by instance %d with %d of %d admitted in the window ending %d (%s, %s); the instance has served it since %v",
			k.name, in.n, kw.admitted, kw.max, kw.end, kw.kind, kw.balancer, stint)
	}
}
