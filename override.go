package ratelimit

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// Overrides: one key's limits set at runtime through the admin API, without
// a reload. An override gives the requests counted under its key, in any of
// the handler's limits, a plan by name or values of its own, until it
// expires. A memory zone keeps its overrides in the process (a reload keeps
// them, a restart loses them); a Redis zone keeps them in Redis, where
// every instance reads them.

// MaxOverrides bounds the overrides of one zone.
const MaxOverrides = 10000

// MaxOverrideTTL bounds how long an override may be set for.
const MaxOverrideTTL = 366 * 24 * time.Hour

// OverridePlan names, in {http.rate_limit.plan}, the values an override
// gives a key, when it gives values and not a plan by name.
const OverridePlan = "override"

// Events of an override set or removed through the admin API, emitted on
// the instance that took the call. Their data: zone, key, and for a set
// override its plan, max, burst, off, limits and expires (Unix seconds,
// 0 for never).
const (
	EventOverrideSet     = "rate_limit_override_set"
	EventOverrideRemoved = "rate_limit_override_removed"
)

// Override is one key's limits, set at runtime: a plan by name, or values
// of its own for the handler's limits, as a plan gives them. A request
// counted under Key in any of the handler's limits runs with them, in every
// limit (when several of its keys have one, the first limit's wins).
type Override struct {
	// Key is the key as the zone's listing shows it: an IP address
	// ("192.0.2.7", or an IPv6 prefix "2001:db8::/64"), "key:" and a key
	// placeholder's value, or "missing:" and a limit's missing value. A
	// listing of a Redis zone that hashes its keys (hash_keys) has no key:
	// Redis holds its hash alone (KeyHash).
	Key string `json:"key,omitempty"`

	// KeyHash is the key's HMAC, as Redis holds it, in a listing of a
	// Redis zone with hash_keys.
	KeyHash string `json:"key_hash,omitempty"`

	// Plan names one of the handler's plans, or "default" for the
	// handler's own values. Either Plan or values (max, burst, off,
	// limits), not both.
	Plan string `json:"plan,omitempty"`

	// PlanConfig holds the override's values, over the handler's own (not
	// over the plan the request had), as a plan in the config gives them.
	PlanConfig

	// TTL, when setting an override, is how long it lasts, from 1s to
	// 366 days. Default: until it is removed.
	TTL caddy.Duration `json:"ttl,omitempty"`

	// Expires is when the override lapses, in Unix seconds; 0 for never.
	// When setting one, give TTL or Expires, not both.
	Expires int64 `json:"expires,omitempty"`

	tag string // what names Key in the zone's table (Store.Tag)
}

// OverrideList is the reply to GET /rate_limit/<zone>/overrides.
type OverrideList struct {
	// Zone is the zone's name.
	Zone string `json:"zone"`
	// Overrides are the zone's overrides in force, by key.
	Overrides []Override `json:"overrides"`
	// Max is the most overrides the zone keeps (MaxOverrides).
	Max int `json:"max"`
}

// live reports whether o is in force at now.
func (o *Override) live(now time.Time) bool {
	return o.Expires == 0 || now.Unix() < o.Expires
}

// overrideTable is a zone's overrides in force, by tag (Store.Tag of the
// key). It is never written once published: a change publishes another.
type overrideTable struct {
	byTag map[string]*Override
}

// zoneOverrides is a zone's overrides: the table requests read, and the
// lock that orders changes to it.
type zoneOverrides struct {
	mu    sync.Mutex
	table atomic.Pointer[overrideTable] // nil while the zone has none
}

// overrideOf returns the override in force for key at now, or nil.
func (z *zone) overrideOf(key string, now time.Time) *Override {
	t := z.overrides.table.Load()
	if t == nil {
		return nil
	}
	if o := t.byTag[z.store.Tag(key)]; o != nil && o.live(now) {
		return o
	}
	return nil
}

// publishOverrides makes byTag the zone's table. The caller holds
// z.overrides.mu.
func (z *zone) publishOverrides(byTag map[string]*Override) {
	if len(byTag) == 0 {
		z.overrides.table.Store(nil)
		return
	}
	z.overrides.table.Store(&overrideTable{byTag: byTag})
}

// watchOverrides has a zone whose store keeps overrides for the fleet
// read them again whenever they may have changed.
func (z *zone) watchOverrides() {
	if ov, ok := z.store.(limiter.Overrider); ok {
		ov.WatchOverrides(func() { z.loadOverrides(context.Background()) })
	}
}

// loadOverrides reads a fleet zone's overrides from its store, and removes
// those that lapsed. Loads run one at a time, so the last read is the one
// published.
func (z *zone) loadOverrides(ctx context.Context) {
	ov, ok := z.store.(limiter.Overrider)
	if !ok {
		return
	}
	z.overrides.mu.Lock()
	defer z.overrides.mu.Unlock()
	byTag, lapsed, err := z.readOverrides(ctx, ov, z.clock.Now())
	if err != nil {
		return // the table stays; the next change or subscription reads again
	}
	z.publishOverrides(byTag)
	if len(lapsed) > 0 {
		go func() { _, _ = ov.DeleteOverrides(context.Background(), lapsed...) }()
	}
}

// readOverrides returns a fleet zone's overrides in force at now by tag,
// and the tags of those that lapsed. An entry that does not parse (written
// by another version, or by hand) is skipped.
func (z *zone) readOverrides(ctx context.Context, ov limiter.Overrider, now time.Time) (map[string]*Override, []string, error) {
	all, err := ov.Overrides(ctx)
	if err != nil {
		return nil, nil, err
	}
	byTag := make(map[string]*Override, len(all))
	var lapsed []string
	for tag, value := range all {
		o := new(Override)
		if json.Unmarshal([]byte(value), o) != nil {
			continue
		}
		if !o.live(now) {
			lapsed = append(lapsed, tag)
			continue
		}
		if z.store.HashedKeys() {
			o.KeyHash = tag
		}
		o.tag = tag
		byTag[tag] = o
	}
	return byTag, lapsed, nil
}

// setOverride sets o, checked already, as its key's override at now.
func (z *zone) setOverride(ctx context.Context, o *Override, now time.Time) error {
	tag := z.store.Tag(o.Key)
	if ov, ok := z.store.(limiter.Overrider); ok {
		stored := *o
		if z.store.HashedKeys() {
			stored.Key = "" // Redis holds no key the zone hashes
		}
		value, _ := json.Marshal(stored)
		err := ov.SetOverride(ctx, tag, value, MaxOverrides)
		if errors.Is(err, limiter.ErrTooManyOverrides) {
			return tooManyOverrides(z.name)
		}
		return err // the announcement reloaded the table
	}
	z.overrides.mu.Lock()
	defer z.overrides.mu.Unlock()
	byTag := make(map[string]*Override)
	if t := z.overrides.table.Load(); t != nil {
		for k, v := range t.byTag {
			if v.live(now) {
				byTag[k] = v
			}
		}
	}
	if _, ok := byTag[tag]; !ok && len(byTag) >= MaxOverrides {
		return tooManyOverrides(z.name)
	}
	o.tag = tag
	byTag[tag] = o
	z.publishOverrides(byTag)
	return nil
}

// tooManyOverrides is the error of a zone that keeps MaxOverrides: a
// conflict with the zone's state, for the admin API.
func tooManyOverrides(zone string) error {
	return apiError(http.StatusConflict, fmt.Errorf("zone %q keeps %d overrides, the most it may: remove one first", zone, MaxOverrides))
}

// removeOverride removes the override of the key tagged tag
// (Store.Tag), and reports whether it had one.
func (z *zone) removeOverride(ctx context.Context, tag string) (bool, error) {
	if ov, ok := z.store.(limiter.Overrider); ok {
		n, err := ov.DeleteOverrides(ctx, tag)
		return n > 0, err
	}
	z.overrides.mu.Lock()
	defer z.overrides.mu.Unlock()
	t := z.overrides.table.Load()
	if t == nil || t.byTag[tag] == nil {
		return false, nil
	}
	byTag := make(map[string]*Override, len(t.byTag))
	for k, v := range t.byTag {
		if k != tag {
			byTag[k] = v
		}
	}
	z.publishOverrides(byTag)
	return true, nil
}

// listOverrides returns the zone's overrides in force at now, by key: a
// fleet zone's as its store holds them now.
func (z *zone) listOverrides(ctx context.Context, now time.Time) ([]Override, error) {
	var byTag map[string]*Override
	if ov, ok := z.store.(limiter.Overrider); ok {
		var err error
		if byTag, _, err = z.readOverrides(ctx, ov, now); err != nil {
			return nil, err
		}
	} else if t := z.overrides.table.Load(); t != nil {
		byTag = t.byTag
	}
	list := make([]Override, 0, len(byTag))
	for _, o := range byTag {
		if o.live(now) {
			list = append(list, *o)
		}
	}
	slices.SortFunc(list, func(a, b Override) int { return cmp.Or(cmp.Compare(a.Key, b.Key), cmp.Compare(a.KeyHash, b.KeyHash)) })
	return list, nil
}

// overridePlan returns the plan an override gives the request, whose
// replacer is repl, header h and client IP key ipKey, at now: the override
// of its key in the first of the handler's limits that has one. It returns
// nil when none has, or when the override names a plan the handler lacks
// (a zone's handlers share their plans; a reload may drop one).
func (rl *RateLimit) overridePlan(repl *caddy.Replacer, h map[string][]string, ipKey string, now time.Time) *plan {
	for i := range rl.policies {
		key, err := rl.policies[i].resolve(repl, h, ipKey)
		if err != nil || key == "" {
			continue
		}
		if o := rl.zone.overrideOf(key, now); o != nil {
			return rl.planOfOverride(o)
		}
	}
	return nil
}

// overridePlans are a handler's plans of overrides that give values
// (*Override → *plan), built at their first request; built counts the
// builds, to sweep the plans of overrides gone now and then.
type overridePlans struct {
	m     sync.Map
	built atomic.Uint64
}

// planOfOverride returns the plan o gives: one of the handler's, or one of
// o's values, built at its first request and kept while o is.
func (rl *RateLimit) planOfOverride(o *Override) *plan {
	switch o.Plan {
	case "":
	case DefaultPlan:
		return rl.defaultPlan
	default:
		return rl.plans[o.Plan]
	}
	ops := rl.overridePlans
	if p, ok := ops.m.Load(o); ok {
		return p.(*plan)
	}
	p, _ := ops.m.LoadOrStore(o, rl.planFrom(OverridePlan, o.PlanConfig))
	if ops.built.Add(1)%64 == 0 {
		// A changed override is a new one: drop the plans of those the
		// zone no longer has.
		t := rl.zone.overrides.table.Load()
		ops.m.Range(func(k, _ any) bool {
			if o := k.(*Override); t == nil || t.byTag[o.tag] != o {
				ops.m.Delete(k)
			}
			return true
		})
	}
	return p.(*plan)
}

// checkOverride reports what is wrong with o, to be set at now in a zone
// run with s, naming the field and its value; it sets o.Expires from TTL.
func checkOverride(o *Override, s zoneSettings, now time.Time) error {
	if err := checkOverrideKey(o.Key); err != nil {
		return err
	}
	if o.KeyHash != "" {
		return fmt.Errorf("invalid key_hash %q: set an override by its key", o.KeyHash)
	}
	values := o.Max != 0 || o.Burst != 0 || o.Off || o.MaxInFlight != 0 || len(o.Limits) > 0
	switch {
	case o.Plan != "" && values:
		return fmt.Errorf("invalid override of %q: plan %q and values; give one or the other", o.Key, o.Plan)
	case o.Plan == "" && !values:
		return fmt.Errorf("invalid override of %q: give a plan, or values (max, burst, off, limits)", o.Key)
	case o.Plan != "" && o.Plan != DefaultPlan && !slices.Contains(s.plans.names, o.Plan):
		return fmt.Errorf("invalid plan %q: zone %q has the plans %s", o.Plan, s.plans.zone, strings.Join(append([]string{DefaultPlan}, s.plans.names...), ", "))
	}
	if values {
		if errs := s.plans.check("override", o.PlanConfig); len(errs) > 0 {
			return errors.Join(errs...)
		}
	}
	ttl := time.Duration(o.TTL)
	switch {
	case ttl != 0 && o.Expires != 0:
		return fmt.Errorf("invalid override of %q: ttl %s and expires %d; give one or the other", o.Key, ttl, o.Expires)
	case ttl != 0 && (ttl < time.Second || ttl > MaxOverrideTTL):
		return fmt.Errorf("invalid ttl %s: must be from 1s to %s", ttl, MaxOverrideTTL)
	case ttl != 0:
		o.Expires, o.TTL = now.Add(ttl+time.Second-1).Unix(), 0 // a whole second at least
	case o.Expires != 0 && (o.Expires <= now.Unix() || o.Expires > now.Add(MaxOverrideTTL).Unix()):
		return fmt.Errorf("invalid expires %d: must be a Unix time within %s from now (%d)", o.Expires, MaxOverrideTTL, now.Unix())
	}
	return nil
}

// checkOverrideKey reports a key no request is counted under: one that is
// neither an IP address (or IPv6 prefix), nor "key:" or "missing:" and a
// value customKey keeps as it is, nor a hashed custom key. Such a key could
// never apply, so nothing is stored for it.
func checkOverrideKey(key string) error {
	invalid := fmt.Errorf("invalid key %q: not a key requests are counted under; give it as the zone's listing shows it (192.0.2.7, 2001:db8::/64, key:<value>, missing:<value>)", key)
	if rest, ok := strings.CutPrefix(key, customKeyPrefix); ok {
		if hash, ok := strings.CutPrefix(rest, hashedKeyPrefix); ok {
			if len(hash) != 32 || strings.Trim(hash, "0123456789abcdef") != "" {
				return invalid
			}
			return nil
		}
		if rest == "" || customKey(rest) != key {
			return invalid
		}
		return nil
	}
	if rest, ok := strings.CutPrefix(key, missingKeyPrefix); ok {
		if checkMissing("missing", rest) != nil || rest == MissingIP || rest == MissingReject {
			return invalid
		}
		return nil
	}
	if a, err := netip.ParseAddr(key); err == nil && a.Zone() == "" && !a.Is4In6() && a.String() == key {
		return nil
	}
	if p, err := netip.ParsePrefix(key); err == nil && p.Addr().Is6() && p.Masked() == p && p.String() == key {
		return nil
	}
	return invalid
}
