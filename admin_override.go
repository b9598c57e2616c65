package ratelimit

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2"
)

// The overrides endpoint of a zone, under the admin API and the console:
//
//	GET    /rate_limit/<zone>/overrides          the zone's overrides in force
//	PUT    /rate_limit/<zone>/overrides          set one: an Override as the body
//	DELETE /rate_limit/<zone>/overrides?key=KEY  remove the key's override
//	                                  (or ?key_hash=, as hash_keys lists it)
//
// As with an unblock, the key travels in the body or the query, never in
// the path.

// overridesPath is the path segment, after a zone's name, of its overrides.
const overridesPath = "/overrides"

// maxOverrideBody bounds the body of a PUT: an override with a value for
// each of a handler's limits is a few hundred bytes.
const maxOverrideBody = 64 << 10

// zoneOverridesPath returns the zone name of path when path (escaped, after
// /rate_limit/ or the console's api/) is a zone's overrides endpoint.
func zoneOverridesPath(rest string) (string, bool) {
	return strings.CutSuffix(rest, overridesPath)
}

// serveOverrides answers a request to the overrides of zone name.
func serveOverrides(w http.ResponseWriter, r *http.Request, name string) error {
	z := findZone(name)
	if z == nil {
		return apiError(http.StatusNotFound, fmt.Errorf("unknown rate limit zone %q", name))
	}
	switch r.Method {
	case http.MethodGet:
		if _, err := parseQuery(r.URL.RawQuery); err != nil {
			return apiError(http.StatusBadRequest, err)
		}
		list, err := z.listOverrides(r.Context(), z.clock.Now())
		if err != nil {
			return apiError(http.StatusInternalServerError, fmt.Errorf("listing the overrides of zone %q: %v", name, err))
		}
		return writeJSON(w, OverrideList{Zone: z.name, Overrides: list, Max: MaxOverrides})
	case http.MethodPut:
		return putOverride(w, r, z)
	case http.MethodDelete:
		return deleteOverride(w, r, z)
	}
	w.Header().Set("Allow", "GET, PUT, DELETE")
	return apiError(http.StatusMethodNotAllowed, fmt.Errorf("method %s not allowed: use GET, PUT or DELETE", r.Method))
}

// putOverride sets the override the body of r holds in z.
func putOverride(w http.ResponseWriter, r *http.Request, z *zone) error {
	if _, err := parseQuery(r.URL.RawQuery); err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	o, err := decodeOverride(r.Body)
	if err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	s, now := z.newest(), z.clock.Now()
	if err := checkOverride(o, s, now); err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	if err := z.setOverride(r.Context(), o, now); err != nil {
		if aerr := (caddy.APIError{}); errors.As(err, &aerr) {
			return err
		}
		return apiError(http.StatusInternalServerError, fmt.Errorf("setting the override of %q in zone %q: %v", o.Key, z.name, err))
	}
	if s.notify != nil {
		s.notify(EventOverrideSet, map[string]any{"key": o.Key, "plan": o.Plan, "max": o.Max, "burst": o.Burst, "max_in_flight": o.MaxInFlight,
			"off": o.Off, "limits": o.Limits, "expires": o.Expires})
	}
	return writeJSON(w, o)
}

// decodeOverride reads one Override from body, strictly: an unknown
// field, a second value or a body past maxOverrideBody is an error.
func decodeOverride(body io.Reader) (*Override, error) {
	data, err := io.ReadAll(io.LimitReader(body, maxOverrideBody+1))
	if err != nil {
		return nil, fmt.Errorf("reading the override: %v", err)
	}
	if len(data) > maxOverrideBody {
		return nil, fmt.Errorf("invalid override: a body of more than %d bytes", maxOverrideBody)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	o := new(Override)
	if err := dec.Decode(o); err != nil {
		return nil, fmt.Errorf("invalid override: %v; want {\"key\": KEY, \"plan\": NAME} or {\"key\": KEY, \"max\": N, ...}", err)
	}
	if dec.More() {
		return nil, errors.New("invalid override: more than one JSON value in the body")
	}
	return o, nil
}

// deleteOverride removes the override of the key r's query names in z:
// by key, or by key_hash (as a zone with hash_keys lists it).
func deleteOverride(w http.ResponseWriter, r *http.Request, z *zone) error {
	params, err := parseQuery(r.URL.RawQuery, "key", "key_hash")
	if err != nil {
		return apiError(http.StatusBadRequest, err)
	}
	key, hash := params["key"], params["key_hash"]
	tag, what := z.store.Tag(key), key
	switch {
	case (key == "") == (hash == ""):
		return apiError(http.StatusBadRequest, errors.New("give one query parameter, key or key_hash: DELETE /rate_limit/ZONE/overrides?key=KEY"))
	case hash != "" && !z.store.HashedKeys():
		return apiError(http.StatusBadRequest, fmt.Errorf("invalid key_hash %q: zone %q does not hash its keys; give the key", hash, z.name))
	case hash != "":
		tag, what = hash, "hash "+hash
	}
	found, err := z.removeOverride(r.Context(), tag)
	if err != nil {
		return apiError(http.StatusInternalServerError, fmt.Errorf("removing the override of %q in zone %q: %v", what, z.name, err))
	}
	if !found {
		return apiError(http.StatusNotFound, fmt.Errorf("%q has no override in zone %q", what, z.name))
	}
	if s := z.newest(); s.notify != nil {
		s.notify(EventOverrideRemoved, map[string]any{"key": key, "key_hash": hash})
	}
	return writeJSON(w, map[string]any{"zone": z.name, "key": key, "key_hash": hash, "removed": true})
}
