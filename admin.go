package ratelimit

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// Paging of a zone's key listing.
const (
	DefaultPageSize = 100  // keys per page when the query gives no limit
	MaxPageSize     = 1000 // the most keys one page may ask for

	// MaxListDepth is the most matches a listing reaches into: offset+limit
	// may not pass it. A page of ranks offset to offset+limit is selected
	// from the best offset+limit matches, which the listing holds while it
	// scans (up to twice as many, see topKeys), so this is what bounds a
	// listing's memory whatever the zone's size: 20,000 KeyStates of 104
	// bytes with their keys, about 2.5 MB with IP keys, 5 MB with the
	// longest custom keys. Ten full pages of the busiest keys are more than
	// anyone reads to find who hammers hardest; any key past them is
	// reached by narrowing the matches (q, policy, limited), which the depth
	// counts.
	MaxListDepth = 10 * MaxPageSize
)

// adminPrefix is the path every endpoint of the admin API is under.
const adminPrefix = "/rate_limit/"

// AdminAPI is the admin endpoint of the rate limiter, module
// admin.api.rate_limit. It is served by Caddy's admin endpoint only, under
// its access controls, and reads the live zones, so it always shows the
// counters requests are being judged against:
//
//	GET    /rate_limit/                 every zone with its settings and totals
//	GET    /rate_limit/<zone>           the zone's tracked keys, busiest first
//	DELETE /rate_limit/<zone>?key=<key> forget a key at once (an unblock)
//	GET    /rate_limit/ui               the dashboard, a page that reads the above
//
// The key listing takes the query parameters limited=true (only keys over
// their limit now), q=<prefix> (only keys starting with it), offset and limit
// (default 100, at most 1000; offset+limit at most MaxListDepth), and
// sort=recent_refusals (the keys refused in the last 5 minutes, most refused
// first, instead of the busiest in their current window). Each listed key
// comes with its unblock path, escaped and ready to use.
//
// A key is text a client chose, so it never travels in the path: a key such
// as "/../../config/" there would be resolved by the HTTP client or Go's mux
// into another admin route. Query strings are parsed strictly (a malformed,
// repeated or unknown parameter is a 400 naming it), and a path with more
// than a zone name under /rate_limit/ is a 400.
//
// AdminAPI has no configuration; its zero value is ready to use.
type AdminAPI struct{}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.rate_limit",
		New: func() caddy.Module { return new(AdminAPI) },
	}
}

// Routes returns the routes of the rate limiter's admin endpoints. The path
// without its final slash is routed too, so that it gets the zone list and
// not a redirect from the mux.
func (a AdminAPI) Routes() []caddy.AdminRoute {
	h := caddy.AdminHandlerFunc(a.serveHTTP)
	return []caddy.AdminRoute{
		{Pattern: adminPrefix, Handler: h},
		{Pattern: strings.TrimSuffix(adminPrefix, "/"), Handler: h},
	}
}

// serveHTTP dispatches on the path: the zone list, or one zone.
func (a AdminAPI) serveHTTP(w http.ResponseWriter, r *http.Request) error {
	path := r.URL.EscapedPath()
	rest, ok := strings.CutPrefix(path+"/", adminPrefix)
	if !ok {
		return apiError(http.StatusNotFound, fmt.Errorf("no rate limit endpoint at %q", path))
	}
	rest = strings.TrimSuffix(rest, "/")
	if rest == "" {
		if err := allowMethod(w, r, http.MethodGet); err != nil {
			return err
		}
		if _, err := parseQuery(r.URL.RawQuery); err != nil {
			return apiError(http.StatusBadRequest, err)
		}
		return writeJSON(w, listZones(r.Context()))
	}
	if rest == dashboardZone {
		return serveDashboard(w, r)
	}
	name, err := url.PathUnescape(rest)
	if err != nil || strings.Contains(name, "/") || name == "." || name == ".." {
		return apiError(http.StatusBadRequest, fmt.Errorf("invalid path %q: want /rate_limit/ZONE; a key goes in the query: DELETE /rate_limit/ZONE?key=KEY", path))
	}
	return serveZone(w, r, name)
}

// serveZone answers a request for zone name: its keys, or an unblock.
func serveZone(w http.ResponseWriter, r *http.Request, name string) error {
	var a AdminAPI
	switch r.Method {
	case http.MethodGet:
		return a.handleZone(w, r, name)
	case http.MethodDelete:
		return a.handleForget(w, r, name)
	}
	w.Header().Set("Allow", "GET, DELETE")
	return apiError(http.StatusMethodNotAllowed, fmt.Errorf("method %s not allowed: use GET or DELETE", r.Method))
}

// handleZone answers GET /rate_limit/<zone> with a page of the zone's keys.
func (AdminAPI) handleZone(w http.ResponseWriter, r *http.Request, name string) error {
	params, err := parseQuery(r.URL.RawQuery, "limited", "q", "policy", "offset", "limit", "sort")
	if err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	q, err := parseListQuery(params)
	if err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	z := findZone(name)
	if z == nil {
		return apiError(http.StatusNotFound, fmt.Errorf("unknown rate limit zone %q", name))
	}
	list, err := z.list(r.Context(), q, time.Now())
	var aerr caddy.APIError
	if errors.As(err, &aerr) {
		return err
	}
	if err != nil {
		return apiError(http.StatusInternalServerError, fmt.Errorf("listing zone %q: %v", name, err))
	}
	return writeJSON(w, list)
}

// handleForget answers DELETE /rate_limit/<zone>?key=<key> by forgetting
// the key.
func (AdminAPI) handleForget(w http.ResponseWriter, r *http.Request, name string) error {
	params, err := parseQuery(r.URL.RawQuery, "key", "policy")
	if err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	key, ok := params["key"]
	if !ok || key == "" {
		return apiError(http.StatusBadRequest, fmt.Errorf("missing query parameter key: DELETE /rate_limit/ZONE?key=KEY, as each listed key's unblock gives it"))
	}
	z := findZone(name)
	if z == nil {
		return apiError(http.StatusNotFound, fmt.Errorf("unknown rate limit zone %q", name))
	}
	var found bool
	if name := params["policy"]; name != "" {
		i := slices.IndexFunc(z.limits(), func(l namedLimit) bool { return l.name == name })
		if i < 0 {
			return apiError(http.StatusBadRequest, fmt.Errorf("unknown policy %q in zone %q", name, z.name))
		}
		l := z.limits()[i]
		found, err = z.store.ForgetCheck(r.Context(), limiter.Check{Slot: l.slot, Name: l.storeName, Key: key})
	} else {
		found, err = z.store.Forget(r.Context(), key)
	}
	if err != nil {
		return apiError(http.StatusInternalServerError, fmt.Errorf("forgetting key %q in zone %q: %v", key, name, err))
	}
	// A key only among the recent offenders is unblocked too: the
	// dashboard lists it with an Unblock button.
	if z.forgetOffender(key, params["policy"]) {
		found = true
	}
	if !found {
		return apiError(http.StatusNotFound, fmt.Errorf("key %q is not tracked in zone %q", key, name))
	}
	return writeJSON(w, map[string]any{"zone": name, "key": key, "forgotten": true})
}

// unblockPath is the path and query that unblock key in zone, escaped so
// that any key travels in the query and nowhere else.
func unblockPath(zone, key string) string {
	return adminPrefix + url.PathEscape(zone) + "?key=" + url.QueryEscape(key)
}

// ZoneInfo is one zone in the reply to GET /rate_limit/.
type ZoneInfo struct {
	// Name is the zone's name.
	Name string `json:"name"`
	// Status is "active", or "disabled" when the config naming the zone
	// sets enabled false.
	Status string `json:"status"`
	// Enabled is false when the config naming the zone sets enabled false.
	Enabled bool `json:"enabled"`
	// Store is the kind of store that keeps the zone's counters: "memory"
	// or "redis".
	Store string `json:"store"`
	// Algorithm is how windows are counted: "fixed", "sliding" or "gcra".
	Algorithm string `json:"algorithm"`
	// Policies are the zone's limits, the first (named after the zone, of
	// WindowSeconds and Max) first.
	Policies []PolicyInfo `json:"policies"`
	// WindowSeconds is the length of a window, in seconds.
	WindowSeconds int64 `json:"window_seconds"`
	// Max is the number of requests admitted per key per window.
	Max int `json:"max"`
	// TrackedKeys is the number of keys the store tracks. For a Redis zone
	// they are counted in Redis (all instances' keys), in the background,
	// one count at a time shared by every reader: the number is the last
	// count that finished (see TrackedKeysAgeSeconds), or while none has,
	// what the count under way has found so far (see TrackedKeysPartial).
	// While the store is DEGRADED it is the keys of this instance's local
	// fallback store, which decides then.
	TrackedKeys int `json:"tracked_keys"`
	// TrackedKeysAgeSeconds is how old the count in TrackedKeys is, in
	// whole seconds. A count of a Redis zone is reused until ten times what
	// it took has passed (a second at least), and a reader waits a second at
	// most for a new one, so a large zone's count may be older than the
	// reply. Absent when the keys were counted within the last second.
	TrackedKeysAgeSeconds int64 `json:"tracked_keys_age_seconds,omitempty"`
	// TrackedKeysPartial is true when no count of the Redis zone's keys has
	// finished yet (one takes seconds for hundreds of thousands of keys):
	// TrackedKeys is then what the counts have found so far, a lower bound
	// that may be 0. Absent otherwise.
	TrackedKeysPartial bool `json:"tracked_keys_partial,omitempty"`
	// RejectedTotal is the number of requests refused since the zone was
	// created; config reloads do not reset it.
	RejectedTotal uint64 `json:"rejected_total"`
	// WebSocketConnections is the number of WebSocket connections open
	// through the zone now.
	WebSocketConnections int64 `json:"websocket_connections"`
	// Health is the store's health ("HEALTHY", "DEGRADED", "RECOVERING")
	// where the store reports one; absent otherwise.
	Health string `json:"health,omitempty"`
	// HashedKeys is true when the zone's keys are stored as HMAC-SHA256
	// hashes (a Redis store with hash_keys).
	HashedKeys bool `json:"hashed_keys,omitempty"`
	// SpoofableKey is true while a handler holding the zone goes by a
	// client IP (its key, a limit's key or its missing ip, exempt, or
	// ws_max_connections_per_ip) that clients choose: a request reached it
	// through one of the server's trusted_proxies while
	// trusted_proxies_strict is off and the client IP comes from a header
	// that lists addresses (X-Forwarded-For, the default), whose leftmost
	// entry the client writes. The fix: trusted_proxies_strict, with every
	// proxy in front of Caddy in trusted_proxies. It is recomputed on a
	// reload, from the new config's first proxied request. Absent when
	// false.
	SpoofableKey bool `json:"spoofable_key,omitempty"`
}

// PolicyInfo is one limit of a zone in the reply to GET /rate_limit/.
type PolicyInfo struct {
	// Name is the limit's name: the zone's for the first limit.
	Name string `json:"name"`
	// Max is the number of requests admitted per key per window.
	Max int `json:"max"`
	// WindowSeconds is the length of a window, in seconds.
	WindowSeconds int64 `json:"window_seconds"`
	// Burst is, with algorithm gcra, the bucket's size; absent otherwise.
	Burst int `json:"burst,omitempty"`
	// BanSeconds is how long a key that goes over the limit is banned;
	// absent when the limit does not ban.
	BanSeconds int64 `json:"ban_seconds,omitempty"`
	// BanMaxSeconds is the longest escalated ban; absent without
	// escalation.
	BanMaxSeconds int64 `json:"ban_max_seconds,omitempty"`
}

// KeyInfo is one tracked key in the reply to GET /rate_limit/<zone>.
type KeyInfo struct {
	// Key is the client key: an IP address, an IPv6 prefix or the value of
	// a custom key placeholder.
	Key string `json:"key"`
	// Policy is the limit the key is counted in: the zone's name for the
	// handler's first limit, else the name given with limit.
	Policy string `json:"policy"`
	// Count is the number of requests admitted in the current window.
	Count int `json:"count"`
	// Refused is the number of requests refused in the current window.
	Refused int `json:"refused"`
	// Remaining is the number of requests the key may still make in the
	// current window.
	Remaining int `json:"remaining"`
	// Reset is when the current window ends, in Unix seconds.
	Reset int64 `json:"reset"`
	// Limited is true when the key's next request in this window would be
	// refused (for a sliding window, counting the previous window's weight,
	// as Remaining does), or the key is banned.
	Limited bool `json:"limited"`
	// BannedUntil is when the key's ban ends, in Unix seconds; absent when
	// the key is not banned. The unblock lifts a ban too.
	BannedUntil int64 `json:"banned_until,omitempty"`
	// Unblock is the admin path that forgets the key, escaped and ready to
	// use: DELETE it on the admin endpoint.
	Unblock string `json:"unblock"`
	// RecentRefusals is, in a listing sorted by recent_refusals, the
	// requests of the key that the zone refused, in any limit, since the
	// key entered its summary of offenders, which it leaves 5 minutes
	// after its last refusal; never more than were refused (see
	// docs/admin-api.md). Policy is then the limit that refused it last,
	// and a key the store no longer tracks in that limit is listed with
	// count 0, refused 0, its whole quota remaining and reset 0. Absent in
	// the default order.
	RecentRefusals int64 `json:"recent_refusals,omitempty"`
	// LastRefused is, in a listing sorted by recent_refusals, when the key
	// was last refused, in Unix seconds; absent in the default order.
	LastRefused int64 `json:"last_refused,omitempty"`
}

// KeyList is the reply to GET /rate_limit/<zone>: one page of the zone's
// tracked keys, most requests (admitted and refused) first, ties by key.
type KeyList struct {
	// Zone is the zone's name.
	Zone string `json:"zone"`
	// Total is the number of keys that match the query before paging.
	Total int `json:"total"`
	// Offset is the number of matching keys skipped.
	Offset int `json:"offset"`
	// Limit is the most keys the page holds.
	Limit int `json:"limit"`
	// HashedKeys is true when the zone's Redis store sets hash_keys: the
	// keys listed are then HMAC-SHA256 hashes of the client keys, and
	// DELETE takes either the hash or the client key.
	HashedKeys bool `json:"hashed_keys,omitempty"`
	// SpoofableKey is true while clients behind a trusted proxy choose
	// their own key in the zone, as in the zone list (ZoneInfo): the keys
	// listed may be addresses they made up.
	SpoofableKey bool `json:"spoofable_key,omitempty"`
	// Keys is the page; an empty page is [].
	Keys []KeyInfo `json:"keys"`
}

// listQuery is a parsed key listing query.
type listQuery struct {
	policy      string
	limitedOnly bool
	prefix      string
	offset      int
	pageSize    int
	sort        string // SortCount or SortRecentRefusals
}

// parseQuery parses a raw query string strictly: every parameter is
// name=value, well escaped, given once and one of allowed. The error names
// the offending parameter. url.ParseQuery instead drops a malformed pair and
// keeps the first of repeated ones, so a misspelt filter would silently list
// everything.
func parseQuery(raw string, allowed ...string) (map[string]string, error) {
	params := map[string]string{}
	if raw == "" {
		return params, nil
	}
	for _, pair := range strings.Split(raw, "&") {
		rawName, rawVal, hasVal := strings.Cut(pair, "=")
		name, err := url.QueryUnescape(rawName)
		if err != nil || rawName == "" || strings.Contains(pair, ";") || !hasVal {
			return nil, fmt.Errorf("malformed query parameter %q: want name=value pairs", pair)
		}
		if !slices.Contains(allowed, name) {
			if len(allowed) == 0 {
				return nil, fmt.Errorf("unknown query parameter %q: this endpoint takes none", name)
			}
			return nil, fmt.Errorf("unknown query parameter %q: want %s", name, strings.Join(allowed, ", "))
		}
		val, err := url.QueryUnescape(rawVal)
		if err != nil {
			return nil, fmt.Errorf("malformed query parameter %q: %v", name, err)
		}
		if _, dup := params[name]; dup {
			return nil, fmt.Errorf("query parameter %q given more than once", name)
		}
		params[name] = val
	}
	return params, nil
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
	if q.policy != "" && !slices.ContainsFunc(limits, func(l namedLimit) bool { return l.name == q.policy }) {
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
	out := KeyList{Zone: z.name, Total: total, Offset: q.offset, Limit: q.pageSize, HashedKeys: z.hashedKeys(), SpoofableKey: z.spoofableKey(), Keys: make([]KeyInfo, 0, len(page))}
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
func (z *zone) matches(ctx context.Context, q listQuery, now time.Time, limits []namedLimit) (*topKeys, int, error) {
	best := &topKeys{k: q.offset + q.pageSize}
	if s, ok := z.store.(limiter.RangeSizer); ok {
		n := s.RangeLen()
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
func limitStored(limits []namedLimit, storeName string) (namedLimit, bool) {
	for _, l := range limits {
		if l.storeName == storeName {
			return l, true
		}
	}
	return namedLimit{}, false
}

// currentState returns ks, a key's state in l, as listed at now, and
// whether it is still running. A window a reload shortened is listed as it
// now ends. A banned key is listed until its ban ends, and a GCRA bucket
// may be deeper than a window: neither is cut.
func currentState(l namedLimit, ks limiter.KeyState, now time.Time) (limiter.KeyState, bool) {
	if !ks.BannedUntil.After(now) && !l.limit.GCRA {
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
func keyInfo(zone string, l namedLimit, ks limiter.KeyState, now time.Time) KeyInfo {
	held, limited := l.limit.Weigh(ks, now)
	quota, count := l.limit.Max, ks.Count
	if l.limit.GCRA {
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
		Unblock:   unblockPath(zone, ks.Key),
	}
	if ks.BannedUntil.After(now) {
		ki.BannedUntil = ceilSeconds(ks.BannedUntil.UnixNano())
		ki.Remaining = 0
	}
	return ki
}

// namedLimit is one limit of a zone as the admin API shows it.
type namedLimit struct {
	name      string // as shown: the zone's name for the first limit
	storeName string // as the store keys it: "" for the first limit
	slot      int
	limit     limiter.Limit
}

// limits returns the limits of the config that last named the zone, the
// first first.
func (z *zone) limits() []namedLimit {
	return z.newest().limits
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

// settings returns the limit and the enabled switch of the config that
// last named the zone.
func (z *zone) settings() (limiter.Limit, bool) {
	s := z.newest()
	return s.limits[0].limit, s.enabled
}

// info describes the zone for the zone list.
func (z *zone) info(ctx context.Context) ZoneInfo {
	lim, enabled := z.settings()
	algorithm := AlgorithmFixed
	switch {
	case lim.GCRA:
		algorithm = AlgorithmGCRA
	case lim.Sliding:
		algorithm = AlgorithmSliding
	}
	var policies []PolicyInfo
	for _, l := range z.limits() {
		pi := PolicyInfo{Name: l.name, Max: l.limit.Max, WindowSeconds: int64(l.limit.Window / time.Second),
			BanSeconds: int64(l.limit.Ban / time.Second), BanMaxSeconds: int64(l.limit.BanMax / time.Second)}
		if l.limit.GCRA {
			pi.Burst = cmp.Or(l.limit.Burst, l.limit.Max)
		}
		policies = append(policies, pi)
	}
	zi := ZoneInfo{
		Name:                 z.name,
		Status:               "active",
		Enabled:              enabled,
		Store:                z.kind(),
		Algorithm:            algorithm,
		Policies:             policies,
		WindowSeconds:        int64(lim.Window / time.Second),
		Max:                  lim.Max,
		RejectedTotal:        z.results[resultLimited].Load(),
		WebSocketConnections: z.wsLive.Load(),
		Health:               z.health(),
		HashedKeys:           z.hashedKeys(),
		SpoofableKey:         z.spoofableKey(),
	}
	z.trackedKeys(ctx, &zi)
	if !zi.Enabled {
		zi.Status = "disabled"
	}
	return zi
}

// trackedKeysWait bounds how long the zone list waits for a count of a
// Redis zone's keys that is under way.
const trackedKeysWait = time.Second

// trackedKeys sets the zone's tracked keys in zi. A Redis store's Len counts
// only its local fallback store, so a Redis zone's keys are counted in Redis
// (CountKeys: a walk of the keyspace, paid for by the admin API only, never
// by requests or metrics, and shared by concurrent readers). While the store
// is degraded it is not asked: its fallback is what decides then.
func (z *zone) trackedKeys(ctx context.Context, zi *ZoneInfo) {
	counter, ok := z.store.(limiter.KeyCounter)
	if !ok || z.health() == limiter.HealthDegraded {
		zi.TrackedKeys = z.store.Len()
		return
	}
	ctx, cancel := context.WithTimeout(ctx, trackedKeysWait)
	defer cancel()
	c := counter.CountKeys(ctx)
	zi.TrackedKeys, zi.TrackedKeysPartial = c.N, c.Partial
	zi.TrackedKeysAgeSeconds = int64(max(time.Since(c.At), 0) / time.Second)
}

// listZones describes every zone a loaded config names, sorted by name.
// The zones are described concurrently, so that the list waits for the
// counts of several Redis zones (trackedKeysWait each) at once, not in turn.
func listZones(ctx context.Context) []ZoneInfo {
	live := liveZones()
	out := make([]ZoneInfo, len(live))
	var wg sync.WaitGroup
	for i, z := range live {
		wg.Go(func() { out[i] = z.info(ctx) })
	}
	wg.Wait()
	slices.SortFunc(out, func(a, b ZoneInfo) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// liveZones returns every zone a loaded config names. It holds the pool's
// lock only to copy the pointers.
//
// A reload that moves a zone to another store holds the old zone and the new
// one under the same name for a moment; the newer one is listed.
func liveZones() []*zone {
	byName := map[string]*zone{}
	zones.Range(func(_, v any) bool {
		if z, ok := v.(*zone); ok {
			if old := byName[z.name]; old == nil || z.seq > old.seq {
				byName[z.name] = z
			}
		}
		return true
	})
	return slices.Collect(maps.Values(byName))
}

// findZone returns the zone called name, or nil if no loaded config names it.
func findZone(name string) *zone {
	var found *zone
	zones.Range(func(_, v any) bool {
		if z, ok := v.(*zone); ok && z.name == name && (found == nil || z.seq > found.seq) {
			found = z
		}
		return true
	})
	return found
}

// allowMethod returns a 405 error, with the Allow header set, unless the
// request's method is method.
func allowMethod(w http.ResponseWriter, r *http.Request, method string) error {
	if r.Method == method {
		return nil
	}
	w.Header().Set("Allow", method)
	return apiError(http.StatusMethodNotAllowed, fmt.Errorf("method %s not allowed: use %s", r.Method, method))
}

// apiError wraps err for Caddy's admin endpoint, which answers with a JSON
// body {"error": "..."}.
func apiError(status int, err error) error {
	return caddy.APIError{HTTPStatus: status, Err: err}
}

// writeJSON answers 200 with v as JSON.
func writeJSON(w http.ResponseWriter, v any) error {
	body, err := json.Marshal(v)
	if err != nil {
		return apiError(http.StatusInternalServerError, fmt.Errorf("encoding reply: %v", err))
	}
	w.Header().Set("Content-Type", "application/json")
	_, err = w.Write(append(body, '\n'))
	return err
}

// Interface guards
var _ caddy.AdminRouter = (*AdminAPI)(nil)
