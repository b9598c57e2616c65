package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// planned is what a request on a plan saw: its status, its quota headers,
// and the plan and limit placeholders as a later handler reads them.
type planned struct {
	status                   int
	limit, remaining, policy string
	plan, limitPlaceholder   string
}

// servePlan sends one request from ip whose {http.vars.plan} is plan
// (none when "") through rl.
func servePlan(t *testing.T, rl *RateLimit, ip, plan string) planned {
	t.Helper()
	r := httptest.NewRequest(http.MethodGet, "/", nil)
	repl := caddy.NewReplacer()
	vars := map[string]any{caddyhttp.ClientIPVarKey: ip}
	if plan != "" {
		vars["plan"] = plan
	}
	ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, vars)
	r = r.WithContext(ctx)
	caddyhttp.NewTestReplacer(r)
	repl = r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	var got planned
	w := httptest.NewRecorder()
	err := rl.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) error {
		w.WriteHeader(http.StatusOK)
		return nil
	}))
	// As a later handler, or handle_errors, reads them.
	got.plan = repl.ReplaceAll("{http.rate_limit.plan}", "-")
	got.limitPlaceholder = repl.ReplaceAll("{http.rate_limit.limit}", "-")
	got.status = w.Code
	if herr, ok := err.(caddyhttp.HandlerError); ok {
		got.status = herr.StatusCode
	} else if err != nil {
		t.Fatalf("ServeHTTP: %v", err)
	}
	got.limit, got.remaining, got.policy = w.Header().Get("X-RateLimit-Limit"), w.Header().Get("X-RateLimit-Remaining"), w.Header().Get("RateLimit-Policy")
	return got
}

// Each request gets its plan's limits: its max in the headers and
// placeholders, a limit the plan switches off neither counting nor
// refusing it, an unknown or empty plan the handler's own values; and a
// key has one count whatever its plan, so a bigger plan admits at once
// what is left of it.
func TestPlans(t *testing.T) {
	rl, _ := provisionHandler(t, "plans", 2, true, func(rl *RateLimit) {
		rl.Headers = HeadersBoth
		rl.Limits = []PolicyConfig{{Name: "hourly", Max: 3, Window: caddy.Duration(time.Hour)}}
		rl.PlanBy = "{http.vars.plan}"
		rl.Plans = map[string]PlanConfig{
			"pro":     {PlanLimit: PlanLimit{Max: 5}, Limits: map[string]PlanLimit{"hourly": {Max: 10}}},
			"partner": {PlanLimit: PlanLimit{Max: 4}, Limits: map[string]PlanLimit{"hourly": {Off: true}}},
		}
	})
	// The default plan: 2 a minute, 3 an hour.
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusTooManyRequests} {
		got := servePlan(t, rl, "192.0.2.1", "")
		if got.status != want {
			t.Fatalf("default plan, request %d: %d, want %d", i+1, got.status, want)
		}
		if i == 0 && (got.plan != DefaultPlan || got.limit != "2" || got.limitPlaceholder != "2" ||
			got.policy != `"plans";q=2;w=60, "hourly";q=3;w=3600`) {
			t.Fatalf("default plan: %+v", got)
		}
	}
	if got := servePlan(t, rl, "192.0.2.1", "no-such-plan"); got.status != http.StatusTooManyRequests || got.plan != DefaultPlan {
		t.Fatalf("an unknown plan: %+v, want the default plan's refusal", got)
	}
	// The same key on pro: 5 a minute, of which it spent 2; 10 an hour.
	for i, want := range []int{http.StatusOK, http.StatusOK, http.StatusOK, http.StatusTooManyRequests} {
		got := servePlan(t, rl, "192.0.2.1", "pro")
		if got.status != want {
			t.Fatalf("pro, request %d: %d (%+v), want %d", i+1, got.status, got, want)
		}
		if i == 0 && (got.plan != "pro" || got.limit != "5" || got.limitPlaceholder != "5" || got.remaining != "2" ||
			got.policy != `"plans";q=5;w=60, "hourly";q=10;w=3600`) {
			t.Fatalf("pro: %+v, want its limit 5 with 2 left and its policy", got)
		}
	}
	// partner: no hourly limit, so RateLimit-Policy names the minute's
	// alone, and the hourly count stays where it was.
	other := "192.0.2.2"
	for i := range 4 {
		got := servePlan(t, rl, other, "partner")
		if got.status != http.StatusOK || (i == 0 && got.policy != `"plans";q=4;w=60`) {
			t.Fatalf("partner, request %d: %+v, want admitted under the minute's 4 alone", i+1, got)
		}
	}
	// On pro the minute's count of 4 leaves 1 of 5; the hourly limit
	// counts from 0, for partner's requests never reached it.
	if got := servePlan(t, rl, other, "pro"); got.status != http.StatusOK || got.remaining != "0" {
		t.Fatalf("%s on pro after 4 on partner: %+v, want the last of 5 admitted", other, got)
	}
	if got := servePlan(t, rl, other, "pro"); got.status != http.StatusTooManyRequests {
		t.Fatalf("%s on pro, sixth request of the minute: %d, want 429", other, got.status)
	}
}

// The plan placeholder, and what a plan names, are checked at load.
func TestPlansChecked(t *testing.T) {
	base := func() *RateLimit {
		return &RateLimit{Max: 5, Window: caddy.Duration(time.Minute), Limits: []PolicyConfig{{Name: "daily", Max: 50, Window: caddy.Duration(24 * time.Hour)}}}
	}
	for _, tc := range []struct {
		name string
		set  func(*RateLimit)
		want string
	}{
		{"plans without plan_by", func(rl *RateLimit) { rl.Plans = map[string]PlanConfig{"pro": {}} }, "invalid plans: 1 plans and no plan_by"},
		{"plan_by without plans", func(rl *RateLimit) { rl.PlanBy = "{http.vars.plan}" }, `invalid plan_by "{http.vars.plan}": no plans to choose from`},
		{"plan_by without a placeholder", func(rl *RateLimit) {
			rl.PlanBy, rl.Plans = "pro", map[string]PlanConfig{"pro": {}}
		}, `invalid plan_by "pro": must hold a placeholder`},
		{"the default's name", func(rl *RateLimit) {
			rl.PlanBy, rl.Plans = "{http.vars.plan}", map[string]PlanConfig{"default": {}}
		}, `invalid plan name "default"`},
		{"a hostile name", func(rl *RateLimit) {
			rl.PlanBy, rl.Plans = "{http.vars.plan}", map[string]PlanConfig{"<script>": {}}
		}, `invalid plan name "<script>"`},
		{"an unknown limit", func(rl *RateLimit) {
			rl.PlanBy, rl.Plans = "{http.vars.plan}", map[string]PlanConfig{"pro": {Limits: map[string]PlanLimit{"weekly": {Max: 1}}}}
		}, `invalid plan pro limit "weekly": the handler has no limit of that name`},
		{"burst without gcra", func(rl *RateLimit) {
			rl.PlanBy, rl.Plans = "{http.vars.plan}", map[string]PlanConfig{"pro": {PlanLimit: PlanLimit{Burst: 3}}}
		}, "invalid plan pro burst 3: burst applies to algorithm gcra only"},
		{"off with a max", func(rl *RateLimit) {
			rl.PlanBy, rl.Plans = "{http.vars.plan}", map[string]PlanConfig{"pro": {Limits: map[string]PlanLimit{"daily": {Max: 9, Off: true}}}}
		}, "invalid plan pro limit daily: off with a max, a burst or a max_in_flight"},
		{"a max out of range", func(rl *RateLimit) {
			rl.PlanBy, rl.Plans = "{http.vars.plan}", map[string]PlanConfig{"pro": {PlanLimit: PlanLimit{Max: MaxRequests + 1}}}
		}, "invalid plan pro max 1000000001: must be from 1 to 1000000000"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rl := base()
			tc.set(rl)
			if err := rl.check(); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("check() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// A plan_by that reads a request header lets each client pick its plan:
// the handler says so at load, naming the option.
func TestPlanByHeaderWarns(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	rl := &RateLimit{Zone: "plans-warn", PlanBy: "{http.request.header.X-Plan}", Plans: map[string]PlanConfig{"pro": {PlanLimit: PlanLimit{Max: 9}}}}
	if err := rl.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	defer rl.Cleanup()
	rl.logger = zap.New(core)
	rl.warnClientPlan()
	if n := logs.FilterMessageSnippet("clients choose their own plan").FilterField(zap.String("plan_by", "{http.request.header.X-Plan}")).Len(); n != 1 {
		t.Fatalf("%d warnings naming plan_by, want 1: %v", n, logs.All())
	}
}

// The plan name is read as Caddy's placeholder gives it, whether planOf
// reads it straight (a header, a string variable) or asks the replacer.
func TestPlanName(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		planBy string
		header http.Header
		vars   map[string]any
		want   string
	}{
		{"{http.request.header.X-Plan}", http.Header{"X-Plan": {"pro", "free"}}, nil, "pro,free"},
		{"{http.request.header.x-plan}", http.Header{"X-Plan": {"pro"}}, nil, "pro"},
		{"{http.vars.plan}", nil, map[string]any{"plan": "pro"}, "pro"},
		{"{http.vars.plan}", nil, map[string]any{"plan": 7}, "7"},
		{"{http.vars.plan}", nil, map[string]any{}, ""},
		{"{http.vars.tier}-{http.vars.plan}", nil, map[string]any{"plan": "pro", "tier": "eu"}, "eu-pro"},
	} {
		rl := &RateLimit{PlanBy: tc.planBy}
		rl.planSource()
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.Header = tc.header
		if r.Header == nil {
			r.Header = http.Header{}
		}
		vars := tc.vars
		if vars == nil {
			vars = map[string]any{}
		}
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
		repl := caddyhttp.NewTestReplacer(r)
		if got := rl.planName(repl, r.Header, vars); got != tc.want {
			t.Errorf("plan_by %s: %q, want %q", tc.planBy, got, tc.want)
		}
	}
}
