package limiter

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// The fleet simulator's invariants (redis_sync_sim_test.go runs the
// fleet): each checked as a key's window ends, from docs/redis.md.

// trace prints what in holds of key after an event, when SIM_TRACE names
// the key (for replaying a seed by hand).
func (r *simRun) trace(in *simInstance, key, what string) {
	if r.traced == "" || r.traced != fmt.Sprintf("%d:%s", r.ep, key) {
		return
	}
	y := in.s.table
	ck := cacheKey("", key)
	i, h := y.hashOf(ck)
	sh := &y.shards[i]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e := sh.slab.find(h, ck)
	if e == nil {
		fmt.Printf("%v inst %d: %s (no entry)\n", r.now, in.n, what)
		return
	}
	if strings.HasPrefix(what, "round") {
		h := in.s.windowKey("0", e.end, e.window)
		recs, _ := readRecords(r.mini.HGet(h, in.s.keyOf("", key, "g")), syncIDLen)
		what += fmt.Sprintf(" [redis ttl=%v records=%+v]", r.mini.TTL(h), recs)
	}
	fmt.Printf("%v inst %d (fleet %d rank %d learning %v epoch %s): %s end %d mine %d sent %d fleet %d lease %d spare %d from %d held %d until %v rounds %d\n",
		r.now, in.n, y.fleet.Load(), y.rank.Load(), y.learning(in.clk.Now().UnixMilli()), y.epoch, what, e.end, e.mine, e.sent, e.fleet, e.lease, e.spare, e.budgetFrom, e.held,
		time.Duration(e.leaseUntil-r.base.UnixNano()), e.rounds)
}

// joinedLate reports whether in is one of docs/redis.md's joiners of kw's
// key: it sees the key after another instance's second round in the
// window, or another instance serving the key had not counted it in the
// fleet when it first saw the key (in started later, or had not reached
// Redis within the fleet's horizon: it was DEGRADED).
func (r *simRun) joinedLate(kw *simKeyWindow, in *simInstance) bool {
	for _, o := range r.insts {
		if _, ok := kw.first[o.n]; !ok || o == in {
			continue
		}
		if o.okRounds-kw.firstRounds[o.n] >= 2 || !kw.counted[o.n][in.n] {
			return true
		}
	}
	return false
}

// shareTerm is what an instance that sees n instances spends unannounced of
// max at most: all of it while alone, else half over n.
func shareTerm(max, n int) int {
	if n <= 1 {
		return max
	}
	return (max + 2*n - 1) / (2 * n)
}

// keyWindow returns the record of k's window ending at end, starting it
// (and scheduling its checks) on first use.
func (r *simRun) keyWindow(k *simKey, end int64) *simKeyWindow {
	id := k.name + "@" + strconv.FormatInt(end, 10)
	kw := r.kws[id]
	if kw == nil {
		kw = &simKeyWindow{key: k.name, end: end, max: r.max[k.name], kind: k.kind, balancer: k.balancer,
			byInst: map[int]int{}, unsent: map[int]int{}, lostBy: map[int]int{}, first: map[int]time.Duration{}, counted: map[int]map[int]bool{}, fleetAt: map[int]int{}, joiner: map[int]bool{}, firstRounds: map[int]int{}}
		r.kws[id] = kw
		r.keyWindows++
		endSim := time.UnixMilli(end).Sub(r.base)
		r.checks = append(r.checks, simCheck{at: endSim + 3*simSync + 2*simSkew, kw: kw})
		slices.SortStableFunc(r.checks, func(a, b simCheck) int { return int(a.at - b.at) })
	}
	return kw
}

// faultWithin reports whether a Redis fault was under way at some time in
// [from, to].
func (r *simRun) faultWithin(from, to time.Duration) bool {
	for _, f := range r.faults {
		end := f.until
		if f.restart {
			end = f.at
		}
		if f.trip == 0 && f.at <= to && end >= from {
			return true
		}
	}
	return false
}

// check checks a key-window once its window has ended and every instance
// had a round since: the admitted count within its bound, and Redis's count
// equal to it.
func (r *simRun) check(kw *simKeyWindow) {
	delete(r.kws, kw.key+"@"+strconv.FormatInt(kw.end, 10))
	endSim := time.UnixMilli(kw.end).Sub(r.base)
	startSim := endSim - simWindow
	outage, restart := false, false
	for _, f := range r.faults {
		if f.restart && f.at >= startSim-simSkew && f.at <= endSim+simSkew {
			restart = true
		}
		if !f.restart && f.trip == 0 && f.at <= endSim+simSkew && f.until >= startSim-simSkew {
			outage = true
		}
	}
	bound := kw.max + kw.lost
	if r.spend == SyncShare {
		for _, t := range kw.terms {
			bound += t
		}
		if restart {
			bound += (kw.max + 3) / 4 // docs/redis.md: at most 1.25 × max
		}
	} else {
		n := len(kw.byInst)
		unseen := int(math.Ceil(kw.rate * (2*simSync + simTrip).Seconds()))
		bound = kw.max + kw.lost + (n-1)*min(kw.max, unseen)
		if restart {
			bound = n*kw.max + kw.lost
		}
	}
	if !outage {
		if kw.admitted > bound {
			r.fail("%s admitted %d of max %d in the window ending %d (%s, %s; %d joiners, %d lost with stopped instances), bound %d",
				kw.key, kw.admitted, kw.max, kw.end, kw.kind, kw.balancer, len(kw.terms), kw.lost, bound)
		}
		over := float64(kw.admitted) / float64(kw.max)
		r.worseOf(over, kw.admitted, bound, kw.max)
	}
	r.checkRedis(kw, outage, endSim)
}

// checkRedis compares what Redis holds of kw's window with what the fleet
// admitted, unless a fault or an instance that stopped before sending its
// count leaves the difference unaccounted for.
func (r *simRun) checkRedis(kw *simKeyWindow, outage bool, endSim time.Duration) {
	if outage || r.faultWithin(endSim-simSync-2*simSkew, r.now) {
		r.uncheckedEqual++
		return
	}
	for n := range kw.byInst {
		if in := r.insts[n]; in.lastOK < endSim+simSkew {
			r.uncheckedEqual++
			return
		}
	}
	in := r.insts[0]
	v, err := in.client.HGet(r.ctx, in.s.windowKey("0", kw.end, simWindow.Milliseconds()), in.s.keyOf("", kw.key, "g")).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		r.t.Fatal(err)
	}
	n, err := fleetCount(v)
	if err != nil {
		r.t.Fatal(err)
	}
	held := int64(n)
	r.checkedEqual++
	if held != int64(kw.admitted) {
		r.fail("%s: Redis holds %d for the window ending %d, the fleet admitted %d (%v by instance)",
			kw.key, held, kw.end, kw.admitted, kw.byInst)
	}
}

// checkMemory checks, after one of in's sweeps, that it holds no key it has
// not served in its last two windows.
func (r *simRun) checkMemory(in *simInstance) {
	y := in.s.table
	held := 0
	for i := range y.shards {
		sh := &y.shards[i]
		sh.mu.Lock()
		sh.slab.each(func(e *syncEntry) bool {
			held++
			// Gone within a window and a sweep after its window ends
			// (and a round, if it had counts to send).
			if last, ok := in.lastReq[sh.slab.key(e)]; !ok || r.now-last > 2*simWindow+syncSweepEvery+simSync+2*simSkew {
				r.fail("instance %d still holds %s, last served at %v", in.n, sh.slab.key(e), last)
			}
			return true
		})
		sh.mu.Unlock()
	}
	if n := in.s.Len(); n != held {
		r.fail("instance %d: Len %d, its table holds %d", in.n, n, held)
	}
}
