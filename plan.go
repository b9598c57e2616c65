package ratelimit

import (
	"cmp"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// Plans: each client's limits come from its plan. A plan gives some of the
// handler's limits another max (and burst, with gcra), or switches them
// off. A limit keeps its window in every plan, and a key is counted once
// whatever its plan, so a client moved to a bigger plan mid-window gets the
// new quota at once, against what it has spent. PlanBy names the plan of
// each request; an empty or unknown one gets the handler's own values,
// the plan named DefaultPlan.

// DefaultPlan names the handler's own values: the plan of a request whose
// plan is empty or unknown.
const DefaultPlan = "default"

// MaxPlans bounds the plans of one handler.
const MaxPlans = 1000

// PlanConfig is one plan: its values for the handler's first limit (the one
// the handler's own max and window define), inline, and for its other
// limits by name. A limit the plan does not name keeps the handler's
// values.
type PlanConfig struct {
	PlanLimit

	// Limits are the plan's values for the handler's other limits, by
	// their names.
	Limits map[string]PlanLimit `json:"limits,omitempty"`
}

// PlanLimit is a plan's values for one of the handler's limits.
type PlanLimit struct {
	// Max replaces the limit's max for the plan's clients, from 1 to
	// 1000000000. Default (0): the limit's own.
	Max int `json:"max,omitempty"`

	// Burst replaces the limit's burst (algorithm gcra) for the plan's
	// clients. Default (0): the limit's own.
	Burst int `json:"burst,omitempty"`

	// Off switches the limit off for the plan's clients: it neither counts
	// nor refuses their requests.
	Off bool `json:"off,omitempty"`

	// MaxInFlight replaces the limit's max_in_flight for the plan's
	// clients, 1 to 1000000. Default (0): the limit's own.
	MaxInFlight int `json:"max_in_flight,omitempty"`
}

// plan is a plan as the handler runs it.
type plan struct {
	name any // for {http.rate_limit.plan}, boxed once
	// policies are the handler's, in its order, with the plan's values.
	policies []policy
	header   string // RateLimit-Policy: the limits of the plan that are on
}

// buildPlans builds the default plan from the handler's policies, and each
// configured plan from a copy of them. Provision calls it once the
// policies are built.
func (rl *RateLimit) buildPlans() {
	rl.defaultPlan = newPlan(DefaultPlan, rl.policies)
	rl.plans = nil
	rl.planSource()
	rl.capsInFlight = rl.hasInFlightCap()
	if len(rl.Plans) == 0 {
		return
	}
	rl.plans = make(map[string]*plan, len(rl.Plans))
	for name, pc := range rl.Plans {
		rl.plans[name] = rl.planFrom(name, pc)
	}
}

// planFrom returns the plan named name that pc's values make of the
// handler's own.
func (rl *RateLimit) planFrom(name string, pc PlanConfig) *plan {
	pols := slices.Clone(rl.policies)
	for i := range pols {
		pl := pc.PlanLimit
		if i > 0 {
			pl = pc.Limits[pols[i].name]
		}
		pols[i].applyPlan(pl)
	}
	return newPlan(name, pols)
}

// newPlan returns the plan named name of policies.
func newPlan(name string, policies []policy) *plan {
	var items []string
	for i := range policies {
		if !policies[i].off {
			items = append(items, policies[i].item())
		}
	}
	return &plan{name: name, policies: policies, header: strings.Join(items, ", ")}
}

// applyPlan gives p, a copy of one of the handler's policies, a plan's
// values for it. The copy shares the policy's counters (its reset text,
// its refusal counter), which count the limit whatever the plan.
func (p *policy) applyPlan(pl PlanLimit) {
	p.off = pl.Off
	if pl.Max != 0 {
		p.setMax(pl.Max)
	}
	if pl.Burst != 0 {
		p.check.Limit.Burst = pl.Burst
	}
	if pl.MaxInFlight != 0 {
		p.check.MaxInFlight = pl.MaxInFlight
	}
}

// planOf returns the plan of the request whose replacer is repl, header h
// and variables vars: the one PlanBy names, else the default plan.
func (rl *RateLimit) planOf(repl *caddy.Replacer, h http.Header, vars map[string]any) *plan {
	if rl.plans == nil {
		return rl.defaultPlan
	}
	if p := rl.plans[rl.planName(repl, h, vars)]; p != nil {
		return p
	}
	return rl.defaultPlan
}

// planName returns the plan name PlanBy gives the request: read straight
// from the header or the variable it names (as Caddy's placeholder
// resolves a header, its values joined with commas), without the
// replacer's providers and their boxing, else through the replacer.
func (rl *RateLimit) planName(repl *caddy.Replacer, h http.Header, vars map[string]any) string {
	if rl.planHeader != "" {
		return strings.Join(h[rl.planHeader], ",")
	}
	if rl.planVar != "" {
		if v, ok := vars[rl.planVar].(string); ok {
			return v
		}
	}
	return repl.ReplaceKnown(rl.PlanBy, "")
}

// varsPrefix opens the placeholder of one of the request's variables.
const varsPrefix = "{http.vars."

// planSource sets where planOf reads the plan name: a request header, or
// one of the request's variables (set by vars or map), when PlanBy is
// exactly its placeholder.
func (rl *RateLimit) planSource() {
	rl.planHeader, rl.planVar = requestHeaderOf(rl.PlanBy), ""
	if name, ok := strings.CutPrefix(rl.PlanBy, varsPrefix); ok {
		if name, ok = strings.CutSuffix(name, "}"); ok && name != "" && !strings.ContainsAny(name, "{}\\") {
			rl.planVar = name
		}
	}
}

// warnClientPlan logs, at load, that clients choose their own plan when
// plan_by reads a request header as it arrives.
func (rl *RateLimit) warnClientPlan() {
	if !strings.Contains(rl.PlanBy, keyHeaderPrefix) {
		return
	}
	rl.logger.Warn("clients choose their own plan: plan_by reads a request header, which the client writes",
		zap.String("zone", rl.Zone), zap.String("plan_by", rl.PlanBy),
		zap.String("fix", "name the plan with what the client cannot forge: a map from the API key ({http.vars.…}), or an auth module's claim ({http.auth.user.…})"))
}

// checkPlans reports every invalid plan setting, naming the option and its
// value.
func (rl *RateLimit) checkPlans() []error {
	var errs []error
	switch {
	case len(rl.Plans) > 0 && rl.PlanBy == "":
		errs = append(errs, fmt.Errorf("invalid plans: %d plans and no plan_by to name a request's plan", len(rl.Plans)))
	case len(rl.Plans) == 0 && rl.PlanBy != "":
		errs = append(errs, fmt.Errorf("invalid plan_by %q: no plans to choose from", rl.PlanBy))
	case len(rl.Plans) > MaxPlans:
		errs = append(errs, fmt.Errorf("invalid plans: %d plans, at most %d", len(rl.Plans), MaxPlans))
	}
	if rl.PlanBy != "" {
		if err := checkKey("plan_by", rl.PlanBy); err != nil {
			errs = append(errs, err)
		}
	}
	rules := rl.planRules()
	for _, name := range rules.names {
		if !validLimitName(name) || name == DefaultPlan || name == OverridePlan {
			errs = append(errs, fmt.Errorf("invalid plan name %q: use 1 to %d letters, digits, _ and - only, other than %q (the handler's own values) and %q (an override's)", name, MaxLimitName, DefaultPlan, OverridePlan))
			continue
		}
		errs = append(errs, rules.check("plan "+name, rl.Plans[name])...)
	}
	return errs
}

// planRules are what a plan's values are checked against: the handler's
// algorithm and limits, and its plans' names. The zone keeps its newest
// handler's, to check an override against.
type planRules struct {
	zone      string
	names     []string // the plans, sorted
	algorithm string
	max       int
	window    time.Duration
	burst     int
	limits    []PolicyConfig
}

// planRules returns the handler's plan rules.
func (rl *RateLimit) planRules() planRules {
	names := make([]string, 0, len(rl.Plans))
	for name := range rl.Plans {
		names = append(names, name)
	}
	slices.Sort(names) // errors in a stable order
	return planRules{zone: rl.Zone, names: names, algorithm: rl.Algorithm, max: rl.Max, window: time.Duration(rl.Window),
		burst: rl.Burst, limits: slices.Clone(rl.Limits)}
}

// check reports every invalid value of pc, the values of what (a plan or
// an override), naming it.
func (r planRules) check(what string, pc PlanConfig) []error {
	errs := r.checkLimit(what, r.max, r.window, r.burst, pc.PlanLimit)
	limits := make([]string, 0, len(pc.Limits))
	for limit := range pc.Limits {
		limits = append(limits, limit)
	}
	slices.Sort(limits)
	for _, limit := range limits {
		i := slices.IndexFunc(r.limits, func(l PolicyConfig) bool { return l.Name == limit })
		if i < 0 {
			errs = append(errs, fmt.Errorf("invalid %s limit %q: the handler has no limit of that name", what, limit))
			continue
		}
		l := r.limits[i]
		errs = append(errs, r.checkLimit(what+" limit "+limit, l.Max, time.Duration(l.Window), cmp.Or(l.Burst, r.burst), pc.Limits[limit])...)
	}
	return errs
}

// checkLimit checks a plan's values pl for a limit of max per window,
// and burst.
func (r planRules) checkLimit(what string, max int, window time.Duration, burst int, pl PlanLimit) []error {
	var errs []error
	if pl.Off && (pl.Max != 0 || pl.Burst != 0 || pl.MaxInFlight != 0) {
		errs = append(errs, fmt.Errorf("invalid %s: off with a max, a burst or a max_in_flight", what))
	}
	if err := checkMaxInFlight(what+" max_in_flight", pl.MaxInFlight); err != nil {
		errs = append(errs, err)
	}
	if pl.Max < 0 || pl.Max > MaxRequests {
		errs = append(errs, fmt.Errorf("invalid %s max %d: must be from 1 to %d", what, pl.Max, MaxRequests))
	}
	if pl.Burst != 0 && r.algorithm != AlgorithmGCRA {
		errs = append(errs, fmt.Errorf("invalid %s burst %d: burst applies to algorithm gcra only", what, pl.Burst))
	} else if pl.Burst < 0 || pl.Burst > MaxRequests {
		errs = append(errs, fmt.Errorf("invalid %s burst %d: must be from 1 to %d", what, pl.Burst, MaxRequests))
	} else if r.algorithm == AlgorithmGCRA {
		if err := checkBucket(what+" ", cmp.Or(pl.Max, max), window, cmp.Or(pl.Burst, burst)); err != nil {
			errs = append(errs, err)
		}
	}
	return errs
}
