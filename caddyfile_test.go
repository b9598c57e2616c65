package ratelimit

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"
)

// parse unmarshals a rate_limit block. With wantErr set, it fails the test
// unless parsing fails with an error containing wantErr, and returns nil;
// with wantErr empty it fails the test on any error.
func parse(t *testing.T, input, wantErr string) *RateLimit {
	t.Helper()
	rl := new(RateLimit)
	err := rl.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input))
	if wantErr != "" {
		if err == nil || !strings.Contains(err.Error(), wantErr) {
			t.Fatalf("error = %v, want one containing %q", err, wantErr)
		}
		return nil
	}
	if err != nil {
		t.Fatalf("UnmarshalCaddyfile: %v", err)
	}
	return rl
}

func TestUnmarshalCaddyfile(t *testing.T) {
	t.Parallel()
	off := false
	for _, tc := range []struct {
		name  string
		input string
		want  RateLimit
	}{
		{"empty", `rate_limit`, RateLimit{}},
		{"empty block", `rate_limit {
		}`, RateLimit{}},
		{"every option", `rate_limit {
			zone api
			window 90s
			max 10
			max_tracked 5000
			key {http.request.header.X-API-Key}
			ipv6_prefix 56
			headers both
			gc_interval 30s
			enabled false
		}`, RateLimit{
			Zone: "api", Window: caddy.Duration(90 * time.Second), Max: 10, MaxTracked: 5000,
			Key: "{http.request.header.X-API-Key}", IPv6Prefix: 56, Headers: "both",
			GCInterval: caddy.Duration(30 * time.Second), Enabled: &off,
		}},
		{"window as bare seconds", `rate_limit {
			window 60
		}`, RateLimit{Window: caddy.Duration(time.Minute)}},
		{"window in days", `rate_limit {
			window 1d
		}`, RateLimit{Window: caddy.Duration(24 * time.Hour)}},
		{"camelCase aliases", `rate_limit {
			windowS 30
			maxTracked 2000
		}`, RateLimit{Window: caddy.Duration(30 * time.Second), MaxTracked: 2000}},
		{"ban off in a limit", `rate_limit {
			ban 10m
			limit tenant 20 10s {
				key {http.request.header.X-Tenant}
				ban off
			}
		}`, RateLimit{AbuseControls: AbuseControls{Ban: caddy.Duration(10 * time.Minute)}, Limits: []PolicyConfig{{
			Name: "tenant", Max: 20, Window: caddy.Duration(10 * time.Second), Key: "{http.request.header.X-Tenant}", BanOff: true,
		}}}},
		{"a request limit and a token budget", `rate_limit {
			max 100
			limit tokens 100000 1h {
				key {http.request.header.X-Api-Key}
				charge X-Tokens-Used estimate 500 hide
			}
		}`, RateLimit{Max: 100, Limits: []PolicyConfig{{
			Name: "tokens", Max: 100000, Window: caddy.Duration(time.Hour), Key: "{http.request.header.X-Api-Key}",
			AbuseControls: AbuseControls{Charge: &ChargeConfig{Header: "X-Tokens-Used", Estimate: "500", Hide: true}},
		}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gj, _ := json.Marshal(parse(t, tc.input, ""))
			wj, _ := json.Marshal(tc.want)
			if string(gj) != string(wj) {
				t.Fatalf("got %s\nwant %s", gj, wj)
			}
		})
	}
}

func TestUnmarshalCaddyfileErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		input string
		want  string // a part of the error message
	}{
		{"rate_limit extra", "wrong argument count"},
		{"rate_limit {\n max 0\n}", `invalid max "0": must be at least 1`},
		{"rate_limit {\n max -3\n}", `invalid max "-3": must be at least 1`},
		{"rate_limit {\n max lots\n}", `invalid max "lots": not an integer`},
		{"rate_limit {\n max\n}", "wrong argument count"},
		{"rate_limit {\n max 5 6\n}", `max takes one argument, got extra "6"`},
		{"rate_limit {\n window 0\n}", `invalid window "0": must be at least 1 second`},
		{"rate_limit {\n window -5\n}", `invalid window "-5": must be at least 1 second`},
		{"rate_limit {\n window 500ms\n}", `invalid window "500ms": must be at least 1s`},
		{"rate_limit {\n window soon\n}", `invalid window "soon"`},
		{"rate_limit {\n windowS 1m\n}", `invalid windowS "1m": must be a whole number of seconds`},
		{"rate_limit {\n max_tracked 999\n}", `invalid max_tracked "999": must be at least 1000`},
		{"rate_limit {\n maxTracked 10\n}", `invalid maxTracked "10": must be at least 1000`},
		{"rate_limit {\n ipv6_prefix 129\n}", `invalid ipv6_prefix 129: must be between 1 and 128`},
		{"rate_limit {\n ipv6_prefix 0\n}", `invalid ipv6_prefix "0": must be at least 1`},
		{"rate_limit {\n headers draft\n}", `invalid headers "draft": must be legacy, ietf, both or none`},
		{"rate_limit {\n gc_interval -1s\n}", `invalid gc_interval "-1s": must be positive`},
		{"rate_limit {\n enabled maybe\n}", `invalid enabled "maybe": must be true or false`},
		{"rate_limit {\n burst 5\n}", `invalid burst 5: burst applies to algorithm gcra only`},
		{"rate_limit {\n bursts 5\n}", `unrecognized rate_limit subdirective "bursts"`},
		{"rate_limit {\n algorithm gcra\n burst 0\n}", `invalid burst "0": must be at least 1`},
		{"rate_limit {\n algorithm gcra\n max 1\n window 300d\n burst 2\n}", `invalid burst 2: 2 requests, one every 7200h0m0s, take longer than 8784h0m0s to drip back`},
		{"rate_limit {\n store redis {\n  address 127.0.0.1:6379\n  pipeline maybe\n }\n}", `invalid pipeline "maybe": must be on or off`},
		{"rate_limit {\n store redis {\n  address 127.0.0.1:7000 127.0.0.1:7001\n  pipeline on\n }\n}", `invalid pipeline "on" with 2 addresses (a Cluster)`},
		{"rate_limit {\n algorithm bucket\n}", `invalid algorithm "bucket": must be fixed, sliding or gcra`},
		{"rate_limit {\n count_status\n}", "wrong argument count"},
		{"rate_limit {\n count_status 6xx\n}", `invalid count_status "6xx": want a status from 200 to 599`},
		{"rate_limit {\n count_status 401 all\n}", `invalid count_status "401 all": all counts every status and stands alone`},
		{"rate_limit {\n count_status 499-400\n}", `invalid count_status "499-400"`},
		{"rate_limit {\n count_status 40\n}", `invalid count_status "40"`},
		{"rate_limit {\n count_status 100\n}", `invalid count_status "100": want a status from 200 to 599`},
		{"rate_limit {\n count_status 1xx\n}", `invalid count_status "1xx": want a status from 200 to 599`},
		{"rate_limit {\n count_status 101-199\n}", `invalid count_status "101-199": want a status from 200 to 599`},
		{"rate_limit {\n count_status 150-250\n}", `invalid count_status "150-250": want a status from 200 to 599`},
		{"rate_limit {\n delay 1ns\n}", `invalid delay 1ns: must be from 1ms to 1m0s`},
		{"rate_limit {\n delay 999us\n}", `invalid delay 999µs: must be from 1ms to 1m0s`},
		{"rate_limit {\n limit team 5 1m {\n  ban off\n  ban 1m\n }\n}", `option ban given twice`},
		{"rate_limit {\n cost -1\n}", `invalid cost "-1": must be a whole number from 0 to 1000000000, or a placeholder`},
		{"rate_limit {\n cost lots\n}", `invalid cost "lots"`},
		{"rate_limit {\n max_in_flight 2000000\n}", `invalid max_in_flight 2000000: must be from 1 to 1000000`},
		{"rate_limit {\n limit team 5 1m {\n  max_in_flight -1\n }\n}", `invalid limit team max_in_flight "-1"`},
		{"rate_limit {\n window hour\n algorithm gcra\n}", `invalid window calendar "hour" with algorithm gcra: a GCRA bucket has no window to align`},
		{"rate_limit {\n window day\n time_zone Mars/Olympus\n}", `invalid time_zone "Mars/Olympus"`},
		{"rate_limit {\n time_zone Europe/Berlin\n}", `invalid time_zone "Europe/Berlin": no limit has a calendar window`},
		{"rate_limit {\n cost {http.request.header.X\n}", `invalid cost "{http.request.header.X": placeholder at offset 0 is not closed`},
		{"rate_limit {\n ban\n}", `ban takes a duration`},
		{"rate_limit {\n ban 500ms\n}", `invalid ban 500ms: must be from 1s to`},
		{"rate_limit {\n ban 1m forever\n}", `ban takes a duration, then optionally escalate`},
		{"rate_limit {\n ban 1m escalate 30s\n}", `invalid ban_max 30s: the longest escalated ban must be above the ban (1m0s)`},
		{"rate_limit {\n ban 48h escalate\n}", `the default longest ban is 24h0m0s; name a longer one`},
		{"rate_limit {\n delay 2m\n}", `invalid delay 2m0s: must be from 1ms to 1m0s`},
		{"rate_limit {\n delay_per_key 2\n}", `they bound delay, which is not set`},
		{"rate_limit {\n delay 1s\n ban 1m\n}", `a handler that bans cannot delay`},
		{"rate_limit {\n limit x 5 1m {\n  ban 1m escalate 10s\n }\n}", `invalid limit "x" ban_max 10s`},
		{"rate_limit {\n limit x 5 1m {\n  burst 3\n }\n}", `invalid limit "x" burst 3: burst applies to algorithm gcra only`},
		{"rate_limit {\n limit x 5 1m {\n  count_status 7xx\n }\n}", `invalid limit "x" count_status "7xx"`},
		{"rate_limit {\n limit x 5 1m {\n  cost -1\n }\n}", `invalid limit "x" cost "-1"`},
		{"rate_limit {\n limit x 5 1m {\n  delay 1s\n }\n}", `unrecognized limit option "delay"`},
		{"rate_limit {\n charge\n}", `charge takes a response header`},
		{"rate_limit {\n charge X-Tokens later\n}", `charge: unknown argument "later"`},
		{"rate_limit {\n charge X-Tokens estimate\n}", `charge: unknown argument "estimate"`},
		{"rate_limit {\n charge {http.request.header.X-Tokens}\n}", `invalid charge "{http.request.header.X-Tokens}": name a response header, not a placeholder`},
		{"rate_limit {\n charge \"X Tokens\"\n}", `invalid charge "X Tokens": must be a response header's name`},
		{"rate_limit {\n charge X-Tokens\n cost 2\n}", `invalid charge "X-Tokens" beside cost "2"`},
		{"rate_limit {\n charge X-Tokens estimate 0\n}", `invalid charge estimate "0": must be at least 1`},
		{"rate_limit {\n charge X-Tokens estimate 1000000001\n}", `invalid charge estimate "1000000001"`},
		{"rate_limit {\n algorithm gcra\n charge X-Tokens\n}", `invalid charge "X-Tokens": algorithm gcra does not charge by the response`},
		{"rate_limit {\n limit tokens 1000 1h {\n  charge X-Tokens\n  cost 3\n }\n}", `invalid limit "tokens" charge "X-Tokens" beside cost "3"`},
		{"rate_limit {\n zone\n}", "wrong argument count"},
		{"rate_limit {\n zone a/b\n}", `invalid zone "a/b": use letters, digits and _ - . : only`},
		{"rate_limit {\n key apikey\n}", `invalid key "apikey": must hold a placeholder`},
		{"rate_limit {\n window 9223372036\n}", `invalid window "9223372036": must be at most 31622400 seconds`},
		{"rate_limit {\n window 99999999999999999999\n}", `invalid window "99999999999999999999": must be at most`},
		{"rate_limit {\n window 106751d\n}", `must be at most 8784h0m0s`},
		{"rate_limit {\n window 1500ms\n}", `invalid window 1.5s: must be a whole number of seconds`},
		{"rate_limit {\n gc_interval 1ns\n}", `invalid gc_interval 1ns: must be at least 1s`},
		{"rate_limit {\n max 9223372036854775807\n}", `invalid max 9223372036854775807: must be from 1 to 1000000000`},
		{"rate_limit {\n max 1000000001\n}", `invalid max 1000000001: must be from 1 to 1000000000`},
		{"rate_limit {\n zone \"\"\n}", `invalid zone "": must not be empty`},
		{"rate_limit {\n zone ..\n}", `invalid zone ".."`},
		{"rate_limit {\n key \"\"\n}", `invalid key "": must not be empty`},
		{"rate_limit {\n key {http.request.header.X\n}", `invalid key "{http.request.header.X": placeholder at offset 0 is not closed with }`},
		{"rate_limit {\n key \"{a}{b\"\n}", `invalid key "{a}{b": placeholder at offset 3 is not closed with }`},
		{"rate_limit {\n key \"{a{b}\"\n}", `invalid key "{a{b}": placeholder at offset 0 is not closed with }`},
		{"rate_limit {\n key x{}\n}", `invalid key "x{}": empty placeholder {} at offset 1`},
		{"rate_limit {\n key \\{http.request.header.X}\n}", `} at offset 23 closes no placeholder`},
		{"rate_limit {\n key \\{http.request.header.X\\}\n}", `must hold a placeholder`},
		{"rate_limit {\n key {a}}\n}", `invalid key "{a}}": } at offset 3 closes no placeholder`},
		{"rate_limit {\n enabled 1\n}", `invalid enabled "1": must be true or false`},
		{"rate_limit {\n enabled 0\n}", `invalid enabled "0": must be true or false`},
		{"rate_limit {\n enabled T\n}", `invalid enabled "T": must be true or false`},
		{"rate_limit {\n zone a\n zone b\n}", `option zone given twice`},
		{"rate_limit {\n window 1m\n windowS 60\n}", `option window given twice (as window and windowS)`},
		{"rate_limit {\n maxTracked 1000\n max_tracked 1000\n}", `option max_tracked given twice (as maxTracked and max_tracked)`},
	} {
		t.Run(tc.input, func(t *testing.T) {
			parse(t, tc.input, tc.want)
		})
	}
}

// TestValidateJSON covers the checks a JSON config gets at load, where the
// Caddyfile parser never ran.
func TestValidateJSON(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		json string
		want string
	}{
		{`{"max": -1}`, "invalid max -1: must be from 1 to 1000000000"},
		{`{"window": 60}`, "invalid window 60ns: must be at least 1s"},
		{`{"window": "-1m"}`, "invalid window -1m0s"},
		{`{"max_tracked": 10}`, "invalid max_tracked 10: must be at least 1000"},
		{`{"ipv6_prefix": 200}`, "invalid ipv6_prefix 200"},
		{`{"headers": "x"}`, `invalid headers "x"`},
		{`{"gc_interval": "-5s"}`, "invalid gc_interval -5s"},
		{`{"window": "400d"}`, "invalid window 9600h0m0s: must be at most 8784h0m0s"},
		{`{"zone": "a b"}`, `invalid zone "a b"`},
		{`{"key": "static"}`, `invalid key "static"`},
		{`{"key": "{http.request.header.X"}`, `invalid key "{http.request.header.X": placeholder at offset 0 is not closed with }`},
		{`{"max": 1000000001}`, "invalid max 1000000001: must be from 1 to 1000000000"},
		{`{"zone": ".."}`, `invalid zone ".."`},
		{`{"limits": [{"name": "t", "max": 5, "window": "1m", "ban": "1m", "ban_off": true}]}`, `invalid limit "t" ban 1m0s: the limit sets ban_off (ban off) too`},
		{`{"charge": {"header": ""}}`, `invalid charge "": must be a response header's name`},
		{`{"charge": {"header": "X-Tokens", "estimate": "{http.request.uri"}}`, `invalid charge estimate "{http.request.uri"`},
	} {
		t.Run(tc.json, func(t *testing.T) {
			var rl RateLimit
			if err := json.Unmarshal([]byte(tc.json), &rl); err != nil {
				t.Fatal(err)
			}
			err := rl.check()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("check() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
	var ok RateLimit
	if err := json.Unmarshal([]byte(`{"window": "1m", "max": 5, "max_tracked": 1000}`), &ok); err != nil {
		t.Fatal(err)
	}
	if err := ok.check(); err != nil {
		t.Fatalf("check() of a good config = %v", err)
	}
}

// TestAdapt runs the golden files in testdata/adapt: a Caddyfile, a line of
// ten dashes, then the JSON it must adapt to, or "ERROR <text>" for a
// Caddyfile that must fail to adapt with an error containing <text>.
func TestAdapt(t *testing.T) {
	files, err := filepath.Glob("testdata/adapt/*.caddyfiletest")
	if err != nil || len(files) == 0 {
		t.Fatalf("no golden files: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			input, want, ok := strings.Cut(string(data), "\n----------\n")
			if !ok {
				t.Fatalf("%s: no ---------- line", f)
			}
			if msg, isErr := strings.CutPrefix(strings.TrimSpace(want), "ERROR "); isErr {
				_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), map[string]any{"filename": "Caddyfile"})
				if err == nil || !strings.Contains(err.Error(), msg) {
					t.Fatalf("adapt error = %v, want one containing %q", err, msg)
				}
				return
			}
			caddytest.AssertAdapt(t, input+"\n", "caddyfile", strings.TrimSpace(want))
		})
	}
}
