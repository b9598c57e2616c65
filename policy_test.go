package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/textproto"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// provisionPolicies provisions rl as Caddy would and cleans it up when the
// test ends.
func provisionPolicies(t *testing.T, rl *RateLimit) *RateLimit {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	if err := rl.Provision(ctx); err != nil {
		t.Fatalf("provisioning zone %q: %v", rl.Zone, err)
	}
	t.Cleanup(func() {
		rl.Cleanup()
		cancel()
	})
	return rl
}

// An IPv4-mapped exempt range matches the IPv4 clients it names.
func TestExemptMappedRanges(t *testing.T) {
	for _, tc := range []struct {
		exempt string
		ip     string
		want   bool
	}{
		{"::ffff:10.0.0.0/104", "10.1.2.3", true},
		{"::ffff:10.0.0.0/104", "::ffff:10.1.2.3", true},
		{"::ffff:10.0.0.1", "10.0.0.1", true},
		{"10.0.0.0/8", "::ffff:10.9.9.9", true},
		{"10.0.0.0/8", "11.0.0.1", false},
	} {
		p, err := parsePrefix(tc.exempt)
		if err != nil {
			t.Fatalf("%s: %v", tc.exempt, err)
		}
		if got := p.Contains(netip.MustParseAddr(tc.ip).Unmap()); got != tc.want {
			t.Errorf("%s contains %s = %t, want %t", tc.exempt, tc.ip, got, tc.want)
		}
	}
	if _, err := parsePrefix("::ffff:0.0.0.0/80"); err == nil {
		t.Error("an IPv4-mapped /80 was accepted")
	}
}

// A limit that rejects a request without its key wins whatever the order of
// the limits: a first limit with no client IP to count by does not let the
// request through uncounted.
func TestKeylessLimitDoesNotShortCircuit(t *testing.T) {
	t.Parallel()
	rl := provisionPolicies(t, &RateLimit{Zone: "keyless", Limits: []PolicyConfig{
		{Name: "user", Max: 5, Window: caddy.Duration(time.Minute), Key: "{http.request.header.X-User}", Missing: MissingReject},
	}})
	if got := serve(t, rl, ""); got != http.StatusBadRequest {
		t.Errorf("no client IP, no user: status %d, want 400 from the user limit", got)
	}
	if n := rl.zone.results[resultInvalid].Load(); n != 1 {
		t.Errorf("invalid = %d, want 1", n)
	}
}

// Two configs of one zone that name more limits together than there are
// memory slots during a reload never share a slot.
func TestSlotsDuringReload(t *testing.T) {
	t.Parallel()
	limits := func(names ...string) []PolicyConfig {
		var out []PolicyConfig
		for _, n := range names {
			out = append(out, PolicyConfig{Name: n, Max: 5, Window: caddy.Duration(time.Minute)})
		}
		return out
	}
	provisionPolicies(t, &RateLimit{Zone: "slots", Limits: limits("a", "b", "c", "d")}) // still held: a reload in progress
	next := provisionPolicies(t, &RateLimit{Zone: "slots", Limits: limits("e", "f", "g", "h")})
	seen := map[int]string{}
	for _, p := range next.policies {
		if other, dup := seen[p.check.Slot]; dup {
			t.Fatalf("limits %q and %q share slot %d", other, p.name, p.check.Slot)
		}
		seen[p.check.Slot] = p.name
	}
	// Each new limit counts on its own.
	for range 3 {
		serve(t, next, "192.0.2.7")
	}
	list, err := next.zone.list(context.Background(), listQuery{pageSize: 100}, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	perPolicy := map[string]int{}
	for _, k := range list.Keys {
		perPolicy[k.Policy] += k.Count
	}
	for _, name := range []string{"slots", "e", "f", "g", "h"} {
		if perPolicy[name] != 3 {
			t.Errorf("limit %s counts %d, want 3 (%v)", name, perPolicy[name], perPolicy)
		}
	}
}

// A sliding window's key refused because of its previous window is listed
// as limited, with no quota left.
func TestSlidingListing(t *testing.T) {
	t.Parallel()
	rl := provisionPolicies(t, &RateLimit{Zone: "sliding-list", Max: 2, Window: caddy.Duration(time.Minute), Algorithm: AlgorithmSliding})
	now := time.Now()
	t0 := now.Add(-70 * time.Second)
	lim := rl.policies[0].check.Limit
	for _, at := range []time.Time{t0, t0, t0.Add(61 * time.Second)} {
		if _, err := storeHit(rl.zone.store, "192.0.2.8", at, lim); err != nil {
			t.Fatal(err)
		}
	}
	list, err := rl.zone.list(context.Background(), listQuery{pageSize: 100, limitedOnly: true}, now)
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Keys) != 1 || !list.Keys[0].Limited || list.Keys[0].Remaining != 0 || list.Keys[0].Count != 0 {
		t.Fatalf("listing = %+v, want the key limited by its previous window", list)
	}
}

// A key that is exactly one request header's placeholder is read from the
// header directly; every key resolves as Caddy's replacer resolves it, for
// each way a header can be named and sent, hostile values included.
func TestHeaderKeyResolvesAsReplacer(t *testing.T) {
	keys := map[string]string{ // key → the header read directly; "" for the replacer
		"{http.request.header.X-Client}":                               "X-Client",
		"{http.request.header.x-client}":                               "X-Client",
		"{http.request.header.X-CLIENT}":                               "X-Client",
		"{http.request.header.x_client}":                               "X_client",
		"{http.request.header.Authorization}":                          "Authorization",
		"{http.request.header.X Client}":                               "X Client", // not a token: Caddy reads it uncanonicalized too
		"{http.request.header.}":                                       "",
		"{http.request.header.X-Client}-x":                             "",
		"x-{http.request.header.X-Client}":                             "",
		"{http.request.header.X-Client}{http.request.header.X-Client}": "",
		"{http.request.header.X-Client\\}}":                            "",
		"\\{http.request.header.X-Client}":                             "",
		"{http.request.header.{X-Client}}":                             "",
		"{http.request.host}":                                          "",
	}
	sends := [][]string{
		nil,
		{""},
		{"abc"},
		{"a", "b"},
		{"", ""},
		{"a\nb"},
		{"\u202eevil"},
		{strings.Repeat("k", 200)},
		{"h:" + strings.Repeat("0", 32)},
	}
	for key, header := range keys {
		for _, missing := range []string{MissingIP, MissingReject, "anonymous"} {
			p := newPolicy("z", "", limiter.Limit{Window: time.Minute, Max: 1}, key, missing)
			if p.header != header {
				t.Fatalf("key %q: header %q, want %q", key, p.header, header)
			}
			for _, name := range []string{"X-Client", "x-client", "X_client", "X Client", "Authorization"} {
				for _, vals := range sends {
					r := httptest.NewRequest(http.MethodGet, "/", nil)
					for _, v := range vals {
						r.Header[textproto.CanonicalMIMEHeaderKey(name)] = append(r.Header[textproto.CanonicalMIMEHeaderKey(name)], v)
					}
					if name == "X Client" { // sent as it is, as a server keeps a name it cannot canonicalize
						r.Header["X Client"] = vals
					}
					repl := caddyhttp.NewTestReplacer(r)
					got, gotErr := p.resolve(repl, r.Header, "192.0.2.1")

					want, wantErr := "", error(nil)
					if k := repl.ReplaceAll(key, ""); k != p.keyText {
						want = customKey(k)
					} else {
						switch missing {
						case MissingIP:
							want = "192.0.2.1"
						case MissingReject:
							wantErr = p.errInvalid
						default:
							want = missingKeyPrefix + missing
						}
					}
					if got != want || gotErr != wantErr {
						t.Errorf("key %q, missing %q, %s: %q: got %q, %v; the replacer gives %q, %v", key, missing, name, vals, got, gotErr, want, wantErr)
					}
				}
			}
		}
	}
}
