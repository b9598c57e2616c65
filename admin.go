package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strings"

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
//	GET    /rate_limit/<zone>/overrides the zone's overrides (admin_override.go)
//	PUT    /rate_limit/<zone>/overrides set one key's override
//	DELETE /rate_limit/<zone>/overrides?key=<key> remove it
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
	keepPrivate(w.Header()) // errors too: Caddy's admin endpoint writes them to w
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
	overrides := false
	if zone, ok := zoneOverridesPath(rest); ok {
		rest, overrides = zone, true
	}
	name, err := url.PathUnescape(rest)
	if err != nil || strings.Contains(name, "/") || name == "." || name == ".." {
		return apiError(http.StatusBadRequest, fmt.Errorf("invalid path %q: want /rate_limit/ZONE or /rate_limit/ZONE/overrides; a key goes in the query: DELETE /rate_limit/ZONE?key=KEY", path))
	}
	if overrides {
		return serveOverrides(w, r, name)
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
	list, err := z.list(r.Context(), q, z.clock.Now())
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
		i := slices.IndexFunc(z.limits(), func(l zonePolicy) bool { return l.name == name })
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
	// Sync describes a Redis zone in sync mode (store redis { sync });
	// absent in exact mode and for in-process zones.
	Sync *SyncInfo `json:"sync,omitempty"`
}

// SyncInfo is what the zone list shows of a Redis zone in sync mode, as
// this instance sees it.
type SyncInfo struct {
	// Interval is the sync interval, as a duration ("100ms").
	Interval string `json:"interval"`
	// Spend is what an instance spends between two syncs: "share" or
	// "all".
	Spend string `json:"spend"`
	// LagSeconds is how old, at most, the fleet's counts this instance
	// decides from are: the time since its last sync that reached Redis
	// began.
	LagSeconds float64 `json:"lag_seconds"`
	// Instances is how many instances synced the zone in the last three
	// intervals, as the last sync read.
	Instances int `json:"instances"`
	// DroppedDeltas counts the keys whose counts of a window never
	// reached Redis.
	DroppedDeltas uint64 `json:"dropped_deltas"`
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
	// InFlight is the key's requests being served now in a limit with
	// max_in_flight; absent when none.
	InFlight int `json:"in_flight,omitempty"`
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

// keepPrivate marks an answer of the admin API or the console, which holds
// client keys, as one no cache keeps and no browser reads as anything but
// its Content-Type.
func keepPrivate(h http.Header) {
	h.Set("Cache-Control", "no-store")
	h.Set("X-Content-Type-Options", "nosniff")
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
