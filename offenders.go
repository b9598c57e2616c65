package ratelimit

import (
	"cmp"
	"context"
	"hash/maphash"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"
	"unsafe"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// Size and memory of a zone's summary of offenders (offenders).
const (
	// OffenderAge is how long a key stays among a zone's offenders after
	// its last refusal.
	OffenderAge = 5 * time.Minute

	offenderShards = 16 // a shard, and its lock, per 1/16 of the keys
	offenderSlots  = 16 // keys per shard: 256 in all
	// offenderAdmit: a refused key that is not in its full shard takes
	// the place of the shard's least refused key once in this many
	// refusals, at random.
	offenderAdmit = 8
	// offenderKeyBytes holds any key the module makes in the entry
	// itself: "missing:" and a value, or "key:" and a custom key, of at
	// most maxCustomKeyLen bytes. A longer key (a client_ip that is no
	// IP, from a listener of Caddy's) is copied to the heap.
	offenderKeyBytes = len(missingKeyPrefix) + maxCustomKeyLen
)

// offenderSeed hashes keys to shards. It is random per process, so that no
// client can choose keys that crowd one shard.
var offenderSeed = maphash.MakeSeed()

// offenders is a zone's summary of the keys it refused lately, in any of
// its limits: a fixed 256 entries, whatever the traffic, which outlive the
// window that refused them, so that an offender of a one-second limit is
// still named minutes later.
//
// It runs Space-Saving (Metwally, Agrawal and El Abbadi, "Efficient
// computation of frequent and top-k elements in data streams", 2005) in
// each of 16 shards of 16 entries, a key's shard chosen by its hash. A
// refusal of a key in the summary adds one to its count. A key not in it
// takes a free entry; in a full shard it replaces the entry of the fewest
// refusals, inheriting that count plus one, so that a key refused often
// enough is never pushed out by a stream of new ones: in a shard that sees
// N refusals, every key refused more than N/16 times is in it. The
// inherited count is kept as the entry's error, and the summary reports
// count minus error: the refusals seen since the key entered, a count that
// is never too high. (The count with its error decides only who is
// replaced.)
//
// Two departures from the paper:
//   - Age: an entry whose last refusal is more than OffenderAge old is
//     not listed and is the first to be replaced, and its key, refused
//     again, starts from 1. A key refused at least every 5 minutes keeps
//     counting.
//   - Sampling: a key that would replace another in a full shard does so
//     at a random one of its refusals in offenderAdmit. A flood of distinct
//     keys then replaces an entry once in 8 refusals instead of every time,
//     so the counts it inherits stay 8 times lower, and a new offender
//     loses its first few refusals (8 on average) to it.
//
// An update allocates nothing: a key is compared without being copied and
// a new one is copied into its entry's own bytes (the caller's string may
// point into a request's buffer); only a key longer than offenderKeyBytes
// is copied to the heap. It takes the lock of the key's shard only.
//
// The zero value is an empty summary ready to use. It is safe for
// concurrent use.
type offenders struct {
	shards [offenderShards]offenderShard
}

// offenderShard is one shard of the summary: its first n entries are in
// use.
type offenderShard struct {
	mu      sync.Mutex
	n       int
	entries [offenderSlots]offender
}

// offender is one entry of the summary.
type offender struct {
	hash  uint64
	count uint64 // refusals, with the inherited error
	err   uint64 // the count inherited when the key replaced another
	last  int64  // the last refusal, Unix nanoseconds
	limit string // the limit that refused the key last, as the admin API names it
	n     uint8  // the key's length in buf, when long is ""
	long  string // the key, when longer than buf
	buf   [offenderKeyBytes]byte
}

// key returns the entry's key. The string points into the entry: a
// caller that keeps it past the shard's lock copies it.
func (e *offender) key() string {
	if e.long != "" {
		return e.long
	}
	return unsafe.String(&e.buf[0], int(e.n))
}

// setKey copies key into the entry.
func (e *offender) setKey(key string) {
	if len(key) > len(e.buf) {
		e.long, e.n = strings.Clone(key), 0
		return
	}
	e.long, e.n = "", uint8(copy(e.buf[:], key))
}

// refused records that the zone refused key in the named limit at now.
func (o *offenders) refused(key, limit string, now time.Time) {
	h := maphash.String(offenderSeed, key)
	s := &o.shards[h%offenderShards]
	t, stale := now.UnixNano(), now.UnixNano()-int64(OffenderAge)
	s.mu.Lock()
	defer s.mu.Unlock()
	// One pass finds the key, and else the entry it would replace: an
	// aged one, or the fewest refusals (the longest unrefused of those).
	victim := -1
	for i := range s.n {
		e := &s.entries[i]
		if e.hash == h && e.key() == key {
			if e.last < stale {
				e.count, e.err = 0, 0
			}
			e.count++
			e.last, e.limit = t, limit
			return
		}
		if victim < 0 {
			victim = i
			continue
		}
		v := &s.entries[victim]
		switch vStale := v.last < stale; {
		case vStale:
		case e.last < stale, e.count < v.count, e.count == v.count && e.last < v.last:
			victim = i
		}
	}
	inherit := uint64(0)
	switch {
	case s.n < len(s.entries):
		victim = s.n
		s.n++
	case s.entries[victim].last < stale:
	case rand.Uint32()%offenderAdmit != 0:
		return // sampled out: see offenders
	default:
		inherit = s.entries[victim].count
	}
	e := &s.entries[victim]
	e.hash, e.count, e.err, e.last, e.limit = h, inherit+1, inherit, t, limit
	e.setKey(key)
}

// forget drops key from the summary, if the limit that refused it last is
// limit or limit is "". match tells a key its entry holds (on a zone that
// lists HMAC hashes, the hash names it as well as the key). It reports
// whether an entry went.
func (o *offenders) forget(limit string, match func(string) bool) bool {
	found := false
	for i := range o.shards {
		s := &o.shards[i]
		s.mu.Lock()
		for j := 0; j < s.n; {
			if e := &s.entries[j]; (limit == "" || e.limit == limit) && match(e.key()) {
				s.n--
				s.entries[j] = s.entries[s.n]
				s.entries[s.n] = offender{}
				found = true
				continue
			}
			j++
		}
		s.mu.Unlock()
	}
	return found
}

// recentOffender is a key of the summary as the listing reads it.
type recentOffender struct {
	key      string
	limit    string // the limit that refused it last
	refusals uint64 // refusals seen since it entered the summary
	last     time.Time
}

// list returns a copy of the summary's entries refused within OffenderAge
// of now, most refusals first, then the latest refused, then by key.
func (o *offenders) list(now time.Time) []recentOffender {
	stale := now.UnixNano() - int64(OffenderAge)
	var out []recentOffender
	for i := range o.shards {
		s := &o.shards[i]
		s.mu.Lock()
		for j := range s.n {
			if e := &s.entries[j]; e.last >= stale {
				out = append(out, recentOffender{key: strings.Clone(e.key()), limit: e.limit, refusals: e.count - e.err, last: time.Unix(0, e.last)})
			}
		}
		s.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b recentOffender) int {
		if c := cmp.Compare(b.refusals, a.refusals); c != 0 {
			return c
		}
		if c := b.last.Compare(a.last); c != 0 {
			return c
		}
		return strings.Compare(a.key, b.key)
	})
	return out
}

// Listing orders of GET /rate_limit/<zone> (its sort parameter).
const (
	SortCount          = "count"           // most requests in the current window first (the default)
	SortRecentRefusals = "recent_refusals" // most refusals in the last OffenderAge first
)

// listRecent returns one page of the zone's recent offenders that match q,
// each with the live state of its key in the limit that refused it last
// where the store still tracks it (one pass over the store, as the default
// listing makes).
func (z *zone) listRecent(ctx context.Context, q listQuery, limits []zonePolicy, now time.Time) (KeyList, error) {
	recent := z.offenders.list(now)
	// A zone that lists HMAC hashes lists its offenders by hash too.
	if z.store.HashedKeys() {
		for i := range recent {
			recent[i].key = z.store.Tag(recent[i].key)
		}
	}
	recent = slices.DeleteFunc(recent, func(r recentOffender) bool {
		return !strings.HasPrefix(r.key, q.prefix) || q.policy != "" && r.limit != q.policy
	})
	limitOf := func(name string) (zonePolicy, bool) {
		i := slices.IndexFunc(limits, func(l zonePolicy) bool { return l.name == name })
		if i < 0 {
			return zonePolicy{}, false
		}
		return limits[i], true
	}
	type row struct {
		recentOffender
		l       zonePolicy
		known   bool // l is a limit of the running config
		ks      limiter.KeyState
		tracked bool // ks is the key's state now
	}
	rows := make([]row, len(recent))
	byKey := make(map[string]int, len(recent))
	for i, r := range recent {
		rows[i].recentOffender = r
		rows[i].l, rows[i].known = limitOf(r.limit)
		byKey[r.key] = i
	}
	if len(rows) > 0 {
		err := z.store.Range(ctx, now, func(ks limiter.KeyState) bool {
			i, ok := byKey[ks.Key]
			if !ok || !rows[i].known || ks.Name != rows[i].l.storeName {
				return true
			}
			if ks, ok := currentState(rows[i].l, ks, now); ok {
				rows[i].ks, rows[i].tracked = ks, true
			}
			return true
		})
		if err != nil {
			return KeyList{}, err
		}
	}
	out := KeyList{Zone: z.name, Offset: q.offset, Limit: q.pageSize, HashedKeys: z.store.HashedKeys(), Keys: []KeyInfo{}}
	for _, r := range rows {
		var ki KeyInfo
		if r.tracked {
			ki = keyInfo(z.name, r.l, r.ks, now)
		} else {
			// Its window ended, or an unblock on another instance
			// forgot it: no live count, and its next request has the
			// whole quota.
			ki = KeyInfo{Key: r.key, Unblock: unblockPath(z.name, r.key)}
			if r.known {
				ki.Remaining = r.l.limit.Max
				if r.l.limit.GCRA() {
					ki.Remaining = cmp.Or(r.l.limit.Burst, r.l.limit.Max)
				}
			}
		}
		if q.limitedOnly && !ki.Limited {
			continue
		}
		ki.Policy = r.limit
		ki.RecentRefusals, ki.LastRefused = int64(r.refusals), r.last.Unix()
		out.Total++
		if out.Total > q.offset && len(out.Keys) < q.pageSize {
			out.Keys = append(out.Keys, ki)
		}
	}
	return out, nil
}

// forgetOffender drops key from the zone's recent offenders, if the limit
// that refused it last is limit or limit is "", and reports whether it was
// there. On a zone that lists HMAC hashes the hash names it too.
func (z *zone) forgetOffender(key, limit string) bool {
	hashed := z.store.HashedKeys()
	return z.offenders.forget(limit, func(k string) bool {
		return k == key || hashed && z.store.Tag(k) == key
	})
}
