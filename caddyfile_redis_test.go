package ratelimit

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// The store subdirective parses to the store JSON, and every mistake is an
// error naming the option and its value.
func TestUnmarshalCaddyfileStore(t *testing.T) {
	for _, tc := range []struct {
		name, input string
		want        string // the handler's JSON
		wantErr     string
	}{
		{
			name:  "memory",
			input: "rate_limit {\n store memory\n}",
			want:  `{}`,
		},
		{
			name: "redis, every option",
			input: `rate_limit {
				zone api
				store redis {
					address 10.0.0.1:6379 10.0.0.2:6379
					address 10.0.0.3:6379
					master_name mymaster
					username rl
					password {env.REDIS_PASSWORD}
					db 2
					tls
					key_prefix rl:
					timeout 250ms
					on_error deny
					hash_keys {env.RL_SECRET}
				}
			}`,
			want: `{"zone":"api","store":{"type":"redis","addresses":["10.0.0.1:6379","10.0.0.2:6379","10.0.0.3:6379"],` +
				`"master_name":"mymaster","username":"rl","password":"{env.REDIS_PASSWORD}","db":2,"tls":true,` +
				`"key_prefix":"rl:","timeout":250000000,"on_error":"deny","hash_keys":"{env.RL_SECRET}"}}`,
		},
		{
			name:  "redis url",
			input: "rate_limit {\n store redis {\n url redis://u:p@h:6379/1\n }\n}",
			want:  `{"store":{"type":"redis","url":"redis://u:p@h:6379/1"}}`,
		},
		{
			name:  "redis sync",
			input: "rate_limit {\n store redis {\n address a:1\n sync 100ms all\n }\n}",
			want:  `{"store":{"type":"redis","addresses":["a:1"],"sync":100000000,"sync_spend":"all"}}`,
		},
		{
			name:  "redis sync timeout",
			input: "rate_limit {\n store redis {\n address a:1\n sync 100ms\n sync_timeout 2s\n }\n}",
			want:  `{"store":{"type":"redis","addresses":["a:1"],"sync":100000000,"sync_timeout":2000000000}}`,
		},
		{name: "sync_timeout, not a duration", input: "rate_limit {\n store redis {\n address a:1\n sync 1s\n sync_timeout later\n }\n}", wantErr: `invalid sync_timeout "later"`},
		{name: "sync without interval", input: "rate_limit {\n store redis {\n address a:1\n sync\n }\n}", wantErr: "sync takes an interval and optionally share or all, got 0 arguments"},
		{name: "sync, three arguments", input: "rate_limit {\n store redis {\n address a:1\n sync 1s all now\n }\n}", wantErr: "got 3 arguments"},
		{name: "sync, not a duration", input: "rate_limit {\n store redis {\n address a:1\n sync often\n }\n}", wantErr: `invalid sync "often"`},
		{name: "no store type", input: "rate_limit {\n store\n}", wantErr: "wrong argument count"},
		{name: "unknown store", input: "rate_limit {\n store disk\n}", wantErr: `invalid store "disk"`},
		{name: "memory with a block", input: "rate_limit {\n store memory {\n address x:1\n }\n}", wantErr: "store memory takes no block"},
		{name: "redis without address", input: "rate_limit {\n store redis {\n db 1\n }\n}", wantErr: "needs an address or a url"},
		{name: "address and url", input: "rate_limit {\n store redis {\n address a:1\n url redis://b:2\n }\n}", wantErr: "not both"},
		{name: "bad on_error", input: "rate_limit {\n store redis {\n address a:1\n on_error maybe\n }\n}", wantErr: `invalid on_error "maybe"`},
		{name: "bad timeout", input: "rate_limit {\n store redis {\n address a:1\n timeout soon\n }\n}", wantErr: `invalid timeout "soon"`},
		{name: "zero timeout", input: "rate_limit {\n store redis {\n address a:1\n timeout 0s\n }\n}", wantErr: `invalid timeout "0s"`},
		{name: "timeout over 10s", input: "rate_limit {\n store redis {\n address a:1\n timeout 11s\n }\n}", wantErr: `invalid timeout 11s: must be at most 10s`},
		{name: "bad db", input: "rate_limit {\n store redis {\n address a:1\n db -1\n }\n}", wantErr: `invalid db "-1"`},
		{name: "tls with a value", input: "rate_limit {\n store redis {\n address a:1\n tls yes\n }\n}", wantErr: `tls takes no argument, got "yes"`},
		{name: "extra argument", input: "rate_limit {\n store redis {\n address a:1\n username a b\n }\n}", wantErr: `username takes one argument, got extra "b"`},
		{name: "unknown option", input: "rate_limit {\n store redis {\n address a:1\n pool_size 9\n }\n}", wantErr: `unrecognized store redis option "pool_size"`},
		{name: "key_prefix with a brace", input: "rate_limit {\n store redis {\n address a:1\n key_prefix rl{x}:\n }\n}", wantErr: `invalid key_prefix "rl{x}:"`},
		{name: "address without value", input: "rate_limit {\n store redis {\n address\n }\n}", wantErr: "wrong argument count"},
		{name: "empty hash_keys", input: "rate_limit {\n store redis {\n address a:1\n hash_keys \"\"\n }\n}", wantErr: `invalid hash_keys "": must not be empty`},
		{name: "empty key_prefix", input: "rate_limit {\n store redis {\n address a:1\n key_prefix \"\"\n }\n}", wantErr: `invalid key_prefix "": must not be empty`},
		{name: "empty address", input: "rate_limit {\n store redis {\n address \"\"\n }\n}", wantErr: `invalid address "": must be host:port`},
		{name: "address without port", input: "rate_limit {\n store redis {\n address localhost\n }\n}", wantErr: `invalid redis address "localhost": must be host:port`},
		{name: "port 0", input: "rate_limit {\n store redis {\n address localhost:0\n }\n}", wantErr: `invalid redis address "localhost:0": port must be a number from 1 to 65535`},
		{name: "port 65536", input: "rate_limit {\n store redis {\n address localhost:65536\n }\n}", wantErr: `invalid redis address "localhost:65536": port must be`},
		{name: "port by name", input: "rate_limit {\n store redis {\n address localhost:redis\n }\n}", wantErr: `invalid redis address "localhost:redis": port must be`},
		{name: "no host", input: "rate_limit {\n store redis {\n address :6379\n }\n}", wantErr: `invalid redis address ":6379": the host is missing`},
		{name: "address twice", input: "rate_limit {\n store redis {\n address a:1\n address a:1\n }\n}", wantErr: `redis address "a:1" given twice`},
		{name: "timeout under 1ms", input: "rate_limit {\n store redis {\n address a:1\n timeout 999us\n }\n}", wantErr: `invalid timeout 999µs: must be at least 1ms`},
		{name: "option twice", input: "rate_limit {\n store redis {\n address a:1\n timeout 1s\n timeout 2s\n }\n}", wantErr: `option timeout given twice`},
		{name: "store twice", input: "rate_limit {\n store memory\n store redis {\n address a:1\n }\n}", wantErr: `option store given twice`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rl := parse(t, tc.input, tc.wantErr)
			if rl == nil {
				return
			}
			got, _ := json.Marshal(rl)
			if string(got) != tc.want {
				t.Errorf("JSON =\n%s\nwant\n%s", got, tc.want)
			}
		})
	}
}

// provision replaces placeholders, fills in defaults, rejects what only
// shows once placeholders are replaced, and keeps secrets out of the names
// it builds.
func TestStoreConfigProvision(t *testing.T) {
	t.Setenv("RL_TEST_REDIS_PASSWORD", "hunter2")
	t.Setenv("RL_TEST_SECRET", "k")
	t.Setenv("RL_TEST_ADDR", "h:99999")
	sc := &StoreConfig{Type: StoreRedis, Addresses: []string{"127.0.0.1:6390"}, Password: "{env.RL_TEST_REDIS_PASSWORD}", HashKeys: "{env.RL_TEST_SECRET}"}
	if err := sc.provision(); err != nil {
		t.Fatal(err)
	}
	if sc.opts.Password != "hunter2" || string(sc.hashKey) != "k" {
		t.Errorf("placeholders not replaced: password %q, hash key %q", sc.opts.Password, sc.hashKey)
	}
	if sc.KeyPrefix != DefaultRedisKeyPrefix || time.Duration(sc.Timeout) != DefaultRedisTimeout || sc.OnError != limiter.OnErrorLocal {
		t.Errorf("defaults: prefix %q, timeout %s, on_error %q", sc.KeyPrefix, time.Duration(sc.Timeout), sc.OnError)
	}
	if sc.Password != "{env.RL_TEST_REDIS_PASSWORD}" {
		t.Errorf("the config now holds the secret: %q", sc.Password)
	}
	for _, s := range []string{sc.connKey, sc.identity, sc.describe()} {
		if strings.Contains(s, "hunter2") {
			t.Errorf("a name holds the password: %s", s)
		}
	}

	u := &StoreConfig{Type: StoreRedis, URL: "rediss://bob:pw@redis.example:6380/3"}
	if err := u.provision(); err != nil {
		t.Fatal(err)
	}
	if u.opts.Addrs[0] != "redis.example:6380" || u.opts.Username != "bob" || u.opts.Password != "pw" || u.opts.DB != 3 || u.opts.TLSConfig == nil {
		t.Errorf("url not applied: %+v", u.opts)
	}

	for _, tc := range []struct {
		sc      StoreConfig
		wantErr string
	}{
		{StoreConfig{Type: StoreRedis, Addresses: []string{"a:1"}, HashKeys: "{env.RL_TEST_UNSET_SECRET}"}, "invalid hash_keys"},
		{StoreConfig{Type: StoreRedis, URL: "http://x"}, `invalid redis url (redacted): redis: invalid URL scheme: http`},
		{StoreConfig{Type: StoreRedis, Addresses: []string{"a:1", "b:1"}, DB: 1}, "invalid db 1"},
		{StoreConfig{Type: "disk"}, `invalid store type "disk"`},
		{StoreConfig{Addresses: []string{"a:1"}}, "store \"memory\" takes no options"},
		{StoreConfig{Type: StoreRedis, Addresses: []string{"a:1"}, OnError: "maybe"}, `invalid on_error "maybe"`},
		{StoreConfig{Type: StoreRedis, Addresses: []string{"a:1"}, KeyPrefix: "rl}"}, `invalid key_prefix "rl}"`},
		{StoreConfig{Type: StoreRedis, URL: "redis://h:6379/-1"}, "invalid redis url (redacted): invalid db -1: must be 0 or more"},
		{StoreConfig{Type: StoreRedis, URL: "redis://h:0"}, `invalid redis url (redacted): invalid redis address "h:0": port must be`},
		{StoreConfig{Type: StoreRedis, Addresses: []string{"{env.RL_TEST_ADDR}"}}, `invalid redis address "h:99999": port must be a number from 1 to 65535 (from "{env.RL_TEST_ADDR}")`},
		{StoreConfig{Type: StoreRedis, Addresses: []string{"a:1"}, Timeout: caddy.Duration(time.Microsecond)}, "invalid timeout 1µs: must be at least 1ms"},
	} {
		// What a load does: the check, then provisioning (which reads
		// the url and the placeholders).
		err := (&RateLimit{Store: &tc.sc}).check()
		if err == nil {
			err = tc.sc.provision()
		}
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("%+v: error %v, want one containing %q", tc.sc, err, tc.wantErr)
		}
	}
}

// Sync mode refuses at load what it cannot mean, naming the option and
// its value.
func TestSyncConfigErrors(t *testing.T) {
	redis := func(sync time.Duration, edit func(*StoreConfig)) *StoreConfig {
		sc := &StoreConfig{Type: StoreRedis, Addresses: []string{"a:1"}, Sync: caddy.Duration(sync)}
		if edit != nil {
			edit(sc)
		}
		return sc
	}
	for _, tc := range []struct {
		name    string
		rl      RateLimit
		wantErr string
	}{
		{"interval under 10ms", RateLimit{Store: redis(5*time.Millisecond, nil)}, "invalid sync 5ms: must be from 10ms to 10s"},
		{"interval over 10s", RateLimit{Store: redis(11*time.Second, nil), Window: caddy.Duration(time.Minute)}, "invalid sync 11s: must be from 10ms to 10s"},
		{"spend unknown", RateLimit{Store: redis(time.Second, func(sc *StoreConfig) { sc.SyncSpend = "some" })}, `invalid sync_spend "some": must be share or all`},
		{"spend without sync", RateLimit{Store: redis(0, func(sc *StoreConfig) { sc.SyncSpend = "all" })}, `sync_spend "all" needs sync`},
		{"sync_timeout without sync", RateLimit{Store: redis(0, func(sc *StoreConfig) { sc.SyncTimeout = caddy.Duration(time.Second) })}, `sync_timeout 1s needs sync`},
		{"sync_timeout over 10s", RateLimit{Store: redis(time.Second, func(sc *StoreConfig) { sc.SyncTimeout = caddy.Duration(11 * time.Second) })}, `invalid sync_timeout 11s: must be from 1ms to 10s`},
		{"sync_timeout under 1ms", RateLimit{Store: redis(time.Second, func(sc *StoreConfig) { sc.SyncTimeout = caddy.Duration(time.Microsecond) })}, `invalid sync_timeout 1µs: must be from 1ms to 10s`},
		{"on_error deny", RateLimit{Store: redis(time.Second, func(sc *StoreConfig) { sc.OnError = "deny" })}, `invalid on_error "deny" with sync`},
		{"on_error allow", RateLimit{Store: redis(time.Second, func(sc *StoreConfig) { sc.OnError = "allow" })}, `invalid on_error "allow" with sync`},
		{"pipeline on", RateLimit{Store: redis(time.Second, func(sc *StoreConfig) { sc.Pipeline = "on" })}, `invalid pipeline "on" with sync`},
		{"gcra", RateLimit{Store: redis(time.Second, nil), Algorithm: AlgorithmGCRA}, `invalid algorithm "gcra" with sync 1s`},
		{"window under two intervals", RateLimit{Store: redis(time.Second, nil), Window: caddy.Duration(time.Second)}, "invalid window 1s with sync 1s: a window must be at least two sync intervals"},
		{"limit window under two intervals", RateLimit{Store: redis(time.Second, nil), Limits: []PolicyConfig{{Name: "burst", Max: 5, Window: caddy.Duration(time.Second)}}},
			`invalid limit "burst" window 1s with sync 1s`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.rl.check(); err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("Validate: %v, want an error containing %q", err, tc.wantErr)
			}
		})
	}
	ok := RateLimit{Store: redis(100*time.Millisecond, func(sc *StoreConfig) { sc.SyncSpend = "share"; sc.OnError = "local" }), Algorithm: AlgorithmSliding}
	if err := ok.check(); err != nil {
		t.Errorf("sync 100ms share, on_error local, sliding: %v", err)
	}
}

// No error prints a redis url or its password: not a url that fails to
// parse, written literally or as a placeholder, nor one given with an
// address, in Provision, Validate or the Caddyfile parser.
func TestStoreConfigRedactsURL(t *testing.T) {
	const bad = "redis://rl:hunter2@redis.example:notaport/0"
	t.Setenv("RL_TEST_REDIS_URL", bad)
	for _, tc := range []struct {
		name, url string
		address   string
		wantErr   string
	}{
		{name: "literal", url: bad, wantErr: `invalid redis url (redacted): invalid port ":notaport" after host`},
		{name: "placeholder", url: "{env.RL_TEST_REDIS_URL}", wantErr: `invalid redis url (from {env.RL_TEST_REDIS_URL}): invalid port`},
		{name: "bad escape", url: "redis://rl:hunter2%zz@redis.example:6379", wantErr: "invalid redis url (redacted): invalid URL escape"},
		{name: "with an address", url: bad, address: "10.0.0.1:6379", wantErr: `not both: got a url and address "10.0.0.1:6379"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := func() *StoreConfig {
				sc := &StoreConfig{Type: StoreRedis, URL: tc.url}
				if tc.address != "" {
					sc.Addresses = []string{tc.address}
				}
				return sc
			}
			errs := map[string]error{}
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			rl := &RateLimit{Zone: "redact_" + strings.ReplaceAll(tc.name, " ", "_"), Store: store()}
			errs["Provision"] = rl.Provision(ctx)
			input := "rate_limit {\n store redis {\n url " + tc.url + "\n }\n}"
			if tc.address != "" {
				// The check reads the url only to see it is set with an address.
				errs["check"] = (&RateLimit{Store: store()}).check()
				input = "rate_limit {\n store redis {\n address " + tc.address + "\n url " + tc.url + "\n }\n}"
				errs["Caddyfile"] = new(RateLimit).UnmarshalCaddyfile(caddyfile.NewTestDispenser(input))
			} else {
				// The parser keeps the url as written: provisioning what it
				// parsed is where the url is read.
				parsed := new(RateLimit)
				if err := parsed.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input)); err != nil {
					t.Fatal(err)
				}
				errs["Caddyfile, provisioned"] = parsed.Store.provision()
			}
			for name, err := range errs {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Errorf("%s: error = %v, want one containing %q", name, err, tc.wantErr)
				}
				if err != nil && strings.Contains(err.Error(), "hunter2") {
					t.Errorf("%s: the error prints the password: %v", name, err)
				}
			}
		})
	}
}
