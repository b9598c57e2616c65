package ratelimit

import (
	"cmp"
	"context"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// A zone's key listing for the admin API: the query, one pass over the
// store that keeps the best offset+limit matches, and each key's row.

// listQuery is a parsed key listing query.
type listQuery struct {
	policy      string
	limitedOnly bool
	prefix      string
	offset      int
	pageSize    int
	sort        string // SortCount or SortRecentRefusals
}

// parseListQuery reads the listing's query parameters, naming the first bad
// one.
func parseListQuery(params map[string]string) (listQuery, error) {
	q := listQuery{pageSize: DefaultPageSize, sort: SortCount}
	for _, name := range slices.Sorted(maps.Keys(params)) {
		val := params[name]
		var err error
		switch name {
		case "limited":
			switch val {
			case "true":
				q.limitedOnly = true
			case "false":
			default:
				return q, fmt.Errorf("invalid limited %q: must be true or false", val)
			}
		case "q":
			q.prefix = val
		case "policy":
			q.policy = val
		case "offset":
			q.offset, err = strconv.Atoi(val)
			if err != nil || q.offset < 0 {
				return q, fmt.Errorf("invalid offset %q: must be a whole number, at least 0", val)
			}
		case "limit":
			q.pageSize, err = strconv.Atoi(val)
			if err != nil || q.pageSize < 1 || q.pageSize > MaxPageSize {
				return q, fmt.Errorf("invalid limit %q: must be a whole number from 1 to %d", val, MaxPageSize)
			}
		case "sort":
			if val != SortCount && val != SortRecentRefusals {
				return q, fmt.Errorf("invalid sort %q: must be %s or %s", val, SortCount, SortRecentRefusals)
			}
			q.sort = val
		}
	}
	if q.offset > MaxListDepth-q.pageSize { // not offset+pageSize: it may overflow
		return q, fmt.Errorf("invalid offset %d with limit %d: offset+limit must be at most %d; narrow the listing with q, policy or limited=true to reach further keys",
			q.offset, q.pageSize, MaxListDepth)
	}
	return q, nil
}

// list returns one page of the zone's keys that match q.
func (z *zone) list(ctx context.Context, q listQuery, now time.Time) (KeyList, error) {
	limits := z.limits()
	if q.policy != "" && !slices.ContainsFunc(limits, func(l zonePolicy) bool { return l.name == q.policy }) {
		return KeyList{}, apiError(http.StatusBadRequest, fmt.Errorf("unknown policy %q in zone %q", q.policy, z.name))
	}
	if q.sort == SortRecentRefusals {
		return z.listRecent(ctx, q, limits, now)
	}
	best, total, err := z.matches(ctx, q, now, limits)
	if err != nil {
		return KeyList{}, err
	}
	page := best.page(q.offset, q.pageSize)
	out := KeyList{Zone: z.name, Total: total, Offset: q.offset, Limit: q.pageSize, HashedKeys: z.store.HashedKeys(), SpoofableKey: z.spoofableKey(), Keys: make([]KeyInfo, 0, len(page))}
	for _, ks := range page {
		l, _ := limitStored(limits, ks.Name)
		out.Keys = append(out.Keys, keyInfo(z.name, l, ks, now))
	}
	return out, nil
}

// matches counts the zone's keys that match q and keeps the best
// offset+limit of them. The store copies its keys one shard at a time, so no
// lock is held while matches are ranked; keeping only the best offset+limit
// (which parseListQuery caps at MaxListDepth) makes a page of a large zone
// cost one pass and bounded memory.
func (z *zone) matches(ctx context.Context, q listQuery, now time.Time, limits []zonePolicy) (*topKeys, int, error) {
	best := &topKeys{k: q.offset + q.pageSize}
	if n, ok := z.store.RangeLen(); ok {
		if q.offset >= n {
			// The page starts past every key the store could list, so
			// it is empty however they rank: count the matches for the
			// total and hold none. (Keys added during the scan may take
			// the total past the offset; the page is empty all the
			// same, as it would have been a moment earlier.)
			best.k = 0
		}
		// Room for every match, or for the 2k that are held at most. A
		// store that cannot size itself (Redis) lets the buffer grow.
		best.items = make([]limiter.KeyState, 0, min(n+1, 2*best.k))
	}
	total := 0
	err := z.store.Range(ctx, now, func(ks limiter.KeyState) bool {
		l, ok := limitStored(limits, ks.Name)
		if !ok || (q.policy != "" && l.name != q.policy) {
			return true // a limit the config no longer has, or filtered out
		}
		if ks, ok = currentState(l, ks, now); !ok {
			return true
		}
		if !strings.HasPrefix(ks.Key, q.prefix) {
			return true
		}
		if _, limited := l.limit.Weigh(ks, now); q.limitedOnly && !limited {
			return true
		}
		total++
		best.offer(ks)
		return true
	})
	if err != nil {
		return nil, 0, err
	}
	return best, total, nil
}

// limitStored returns the limit of limits that the store keys as
// storeName, which a listed key is counted in.
func limitStored(limits []zonePolicy, storeName string) (zonePolicy, bool) {
	for _, l := range limits {
		if l.storeName == storeName {
			return l, true
		}
	}
	return zonePolicy{}, false
}

// currentState returns ks, a key's state in l, as listed at now, and
// whether it is still running. A window a reload shortened is listed as it
// now ends. A banned key is listed until its ban ends, and a GCRA bucket
// may be deeper than a window: neither is cut.
func currentState(l zonePolicy, ks limiter.KeyState, now time.Time) (limiter.KeyState, bool) {
	if !ks.BannedUntil.After(now) && !l.limit.GCRA() {
		t := now.UnixNano()
		reset := l.limit.End(ks.Reset.UnixNano(), t)
		if t >= reset {
			return ks, false
		}
		ks.Reset = time.Unix(0, reset)
	}
	return ks, true
}

// keyInfo describes ks, a key's current state in l, for zone's listing.
func keyInfo(zone string, l zonePolicy, ks limiter.KeyState, now time.Time) KeyInfo {
	held, limited := l.limit.Weigh(ks, now)
	quota, count := l.limit.Max, ks.Count
	if l.limit.GCRA() {
		// A bucket: what it holds is the count.
		quota = cmp.Or(l.limit.Burst, l.limit.Max)
		count = int(math.Ceil(held))
	}
	ki := KeyInfo{
		Key:       ks.Key,
		Policy:    l.name,
		Count:     count,
		Refused:   ks.Refused,
		Remaining: max(quota-int(math.Ceil(held)), 0),
		Reset:     ceilSeconds(ks.Reset.UnixNano()),
		Limited:   limited,
		InFlight:  ks.InFlight,
		Unblock:   unblockPath(zone, ks.Key),
	}
	if ks.BannedUntil.After(now) {
		ki.BannedUntil = ceilSeconds(ks.BannedUntil.UnixNano())
		ki.Remaining = 0
	}
	return ki
}

// ranksBefore reports whether a is listed before b: more requests (admitted
// and refused) first, then by key, then by limit. A key is unique in its
// limit, so the order is total.
func ranksBefore(a, b limiter.KeyState) bool {
	if ta, tb := a.Count+a.Refused, b.Count+b.Refused; ta != tb {
		return ta > tb
	}
	if a.Key != b.Key {
		return a.Key < b.Key
	}
	return a.Name < b.Name
}

// topKeys keeps the k best-ranked keys offered to it. It buffers offers and,
// each time it holds 2k (at least 64), keeps only the best k; from then on an
// offer that does not rank before the k-th best costs one comparison.
// Selection is by quickselect with random pivots, so a listing costs time
// linear in the number of keys on average, whatever the page, and holds at
// most max(2k, 64) keys at once (peak says how many it did).
type topKeys struct {
	k       int
	items   []limiter.KeyState
	cutoff  limiter.KeyState // the k-th best after the last trim
	trimmed bool             // cutoff is set
	peak    int              // the most keys items held at once
}

// offer considers ks for the top k.
func (t *topKeys) offer(ks limiter.KeyState) {
	if t.k <= 0 || t.trimmed && !ranksBefore(ks, t.cutoff) {
		return
	}
	// A copy of the key: the memory store cuts a shard's keys from one
	// buffer, which a kept key would otherwise keep whole, and the kept keys
	// come from every shard.
	ks.Key = strings.Clone(ks.Key)
	t.items = append(t.items, ks)
	t.peak = max(t.peak, len(t.items))
	if len(t.items) >= 2*t.k && len(t.items) >= 64 {
		selectRank(t.items, t.k-1)
		clear(t.items[t.k:])
		t.items = t.items[:t.k]
		t.cutoff, t.trimmed = t.items[t.k-1], true
	}
}

// page returns the keys ranked offset to offset+size-1, best first.
func (t *topKeys) page(offset, size int) []limiter.KeyState {
	if offset >= len(t.items) {
		return nil
	}
	if offset > 0 {
		selectRank(t.items, offset)
	}
	rest := t.items[offset:]
	if len(rest) > size {
		selectRank(rest, size)
		rest = rest[:size]
	}
	slices.SortFunc(rest, compareRank)
	return rest
}

// selectRank reorders s so that s[n] holds the key that ranks n-th (from 0),
// with every key that ranks before it in s[:n] and every other after it.
func selectRank(s []limiter.KeyState, n int) {
	lo, hi := 0, len(s)-1
	for lo < hi {
		p := lo + rand.IntN(hi-lo+1)
		s[p], s[hi] = s[hi], s[p]
		pivot, i := s[hi], lo
		for j := lo; j < hi; j++ {
			if ranksBefore(s[j], pivot) {
				s[i], s[j] = s[j], s[i]
				i++
			}
		}
		s[i], s[hi] = s[hi], s[i]
		switch {
		case n == i:
			return
		case n < i:
			hi = i - 1
		default:
			lo = i + 1
		}
	}
}

// compareRank orders keys as the listing does, for slices.SortFunc.
func compareRank(a, b limiter.KeyState) int {
	if c := cmp.Compare(b.Count+b.Refused, a.Count+a.Refused); c != 0 {
		return c
	}
	if c := strings.Compare(a.Key, b.Key); c != 0 {
		return c
	}
	return strings.Compare(a.Name, b.Name)
}
