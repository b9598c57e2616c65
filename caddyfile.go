package ratelimit

import (
	"errors"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("rate_limit", parseCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("rate_limit", httpcaddyfile.Before, "basic_auth")
}

// parseCaddyfile sets up the handler from Caddyfile tokens.
func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	rl := new(RateLimit)
	err := rl.UnmarshalCaddyfile(h.Dispenser)
	return rl, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	rate_limit [<matcher>] {
//		zone        <name>                # default "default"; handlers naming one zone share its counters
//		window      <duration>|<calendar> # default 1m; a bare integer is seconds   (alias: windowS)
//		                                  # calendar: hour, day, week, month, from :00, midnight, Monday, the 1st
//		time_zone   <IANA name>           # of calendar windows; default UTC
//		max         <n>                   # default 300 requests per key per window
//		max_in_flight <n>                 # requests of a key served at once; default no cap
//		max_tracked <n>                   # default 100000, at least 1000           (alias: maxTracked)
//		key         <placeholder>         # default: the client IP ({client_ip})
//		ipv6_prefix <bits>                # default 64: IPv6 clients grouped per /64
//		headers     legacy|ietf|both|none # default legacy (X-RateLimit-*)
//		gc_interval <duration>            # default 5m, jittered
//		enabled     true|false            # default true; false passes everything at no cost
//		ws_max_connections_per_ip <n>     # default unlimited                        (alias: wsMaxConnectionsPerIp)
//		ws_reject   close|status          # default close: 1013 Try Again Later; status: 429
//		ws_lease_ttl <duration>           # Redis zones: a dead instance's sockets lapse after it; default 30s
//		missing     ip|reject|<value>     # when key resolves empty; default ip
//		limit <name> <max> <window>|<calendar> [{ # repeatable: more limits, all judged at once
//			key     <placeholder>         # default: the handler's key
//			missing ip|reject|<value>     # default ip
//			max_in_flight <n>             # default: no cap (not the handler's)
//			count_status <status>...|all  # default: the handler's; so are cost, ban and burst
//			cost    <n>|<placeholder>
//			charge  <header> [estimate <n>|<placeholder>] [hide]
//			ban     <duration> [escalate [<longest>]] | off
//			burst   <n>
//		}]
//		plan_by     <placeholder>         # names each request's plan: {plan} set by map, a claim
//		plan <name> {                     # repeatable: the plan's values for the limits (docs/plans.md)
//			max   <n>|off                 # the handler's own limit; default: its max
//			burst <n>                     # gcra; default: the limit's
//			max_in_flight <n>             # the handler's own limit; default: its own
//			limit <name> <max>|off [burst <n>] # one of the limits above
//		}
//		algorithm   fixed|sliding|gcra    # default fixed; gcra: a token bucket
//		burst       <n>                   # gcra: requests at once from a full bucket; default max
//		count_status <status>...          # only these responses count: 401, 4xx, 500-599
//		cost        <n>|<placeholder>     # units a request spends, 0 to read the quota; default 1
//		charge      <header> [estimate <n>|<placeholder>] [hide] # or: what the response reports it cost
//		ban         <duration> [escalate [<longest>]] # refuse an offender this long; escalate doubles, default up to 24h
//		delay       <duration>            # wait up to this long instead of refusing; at most 1m
//		delay_per_key <n>                 # requests of one key waiting at once; default 4
//		delay_total <n>                   # requests waiting at once; default 1000
//		dry_run                           # decide, log and count, but refuse nothing
//		exempt      <cidr>...             # never counted nor limited
//		status      <code>                # refusal status; default 429
//		store memory | store redis {      # default memory
//			address    <host:port>...     # repeat for a Cluster; or: url redis://user:pass@host:6379/0
//			url        <redis-url>
//			master_name <name>            # Sentinel: addresses are Sentinels watching this master
//			username   <name>
//			password   <password>         # e.g. {env.REDIS_PASSWORD}
//			db         <n>                # default 0
//			tls                           # optional
//			key_prefix <prefix>           # default caddy_rate_limit:
//			timeout    <duration>         # per decision, at most 10s; default 100ms
//			on_error   local|allow|deny   # default local
//			hash_keys  <secret>           # optional: HMAC-SHA256 keys in Redis, no raw IPs stored
//			pipeline   on|off             # default off; on: concurrent decisions share round trips
//			sync       <interval> [share|all] # decide in memory, sync counts every interval (docs/redis.md)
//			sync_timeout <duration>       # per sync round trip; default the interval, at least 1s
//		}
//	}
//
// Every option takes exactly one argument and may be given once, except
// store, which takes a block for redis; address and exempt, which take one
// or more and may repeat; count_status, which takes one or more; ban, which
// takes one to three; sync, which takes one or two; limit, which takes
// three and an optional block and may repeat; plan, which takes a name and
// a block and may repeat; and tls and dry_run, which take none. windowS
// takes an integer of seconds only.
func (rl *RateLimit) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := options{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if opt != "limit" && opt != "exempt" && opt != "plan" {
			if err := seen.first(d, opt); err != nil {
				return err
			}
		}
		switch opt {
		case "plan":
			if err := rl.unmarshalPlan(d); err != nil {
				return err
			}
			continue
		case "store":
			if err := rl.unmarshalStore(d); err != nil {
				return err
			}
			continue
		case "limit":
			if err := rl.unmarshalLimit(d); err != nil {
				return err
			}
			continue
		case "dry_run":
			if d.NextArg() {
				return d.Errf("dry_run takes no argument, got %q", d.Val())
			}
			rl.DryRun = true
			continue
		case "exempt":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			rl.Exempt = append(rl.Exempt, args...)
			continue
		}
		if ok, err := rl.AbuseControls.unmarshalOption(d, opt, ""); ok {
			if err != nil {
				return err
			}
			continue
		}
		val, err := oneArg(d, opt)
		if err != nil {
			return err
		}
		switch opt {
		case "zone":
			rl.Zone = val
		case "plan_by":
			rl.PlanBy = val
		case "window":
			if calendarWindow(val) != 0 {
				rl.Calendar = val
				break
			}
			rl.Window, err = parseWindow(d, opt, val, true)
		case "time_zone":
			rl.TimeZone = val
		case "windowS":
			rl.Window, err = parseWindow(d, opt, val, false)
		case "max":
			rl.Max, err = parseInt(d, opt, val, 1)
		case "max_in_flight":
			rl.MaxInFlight, err = parseInt(d, opt, val, 1)
		case "max_tracked", "maxTracked":
			rl.MaxTracked, err = parseIntRule(d, opt, val, maxTrackedRule)
		case "key":
			rl.Key = val
		case "ipv6_prefix":
			rl.IPv6Prefix, err = parseInt(d, opt, val, 1)
		case "headers":
			rl.Headers = val
		case "gc_interval":
			rl.GCInterval, err = parseDuration(d, opt, val)
		case "enabled":
			if val != "true" && val != "false" {
				return d.Errf("invalid enabled %q: must be true or false", val)
			}
			on := val == "true"
			rl.Enabled = &on
		case "ws_max_connections_per_ip", "wsMaxConnectionsPerIp":
			rl.WSMaxConnectionsPerIP, err = parseInt(d, opt, val, 1)
		case "missing":
			rl.Missing = val
		case "algorithm":
			rl.Algorithm = val
		case "status":
			rl.Status, err = parseInt(d, opt, val, 1)
		case "ws_reject":
			rl.WSReject = val
		case "ws_lease_ttl":
			rl.WSLeaseTTL, err = parseDuration(d, opt, val)
		case "delay":
			rl.Delay, err = parseDuration(d, opt, val)
		case "delay_per_key":
			rl.DelayPerKey, err = parseInt(d, opt, val, 1)
		case "delay_total":
			rl.DelayTotal, err = parseInt(d, opt, val, 1)
		default:
			return d.Errf("unrecognized rate_limit subdirective %q", opt)
		}
		if err != nil {
			return err
		}
	}
	// Values are validated in one place, check, which a load runs too; the
	// parser checks only the shape of each option and what JSON cannot
	// express (an explicit 0 or empty value, an option given twice).
	if err := rl.check(); err != nil {
		return d.Errf("%v", err)
	}
	return nil
}

// unmarshalLimit parses "limit <name> <max> <window> [{ key …; missing … }]";
// d is at the limit token. The values are checked with the rest of the
// handler's settings, in one place.
func (rl *RateLimit) unmarshalLimit(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) != 3 {
		return d.Errf("limit takes a name, a max and a window (limit burst 20 1s), got %d arguments", len(args))
	}
	l := PolicyConfig{Name: args[0]}
	var err error
	if l.Max, err = parseInt(d, "limit "+args[0]+" max", args[1], 1); err != nil {
		return err
	}
	if calendarWindow(args[2]) != 0 {
		l.Calendar = args[2]
	} else if l.Window, err = parseWindow(d, "limit "+args[0]+" window", args[2], true); err != nil {
		return err
	}
	seen := options{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if err := seen.first(d, opt); err != nil {
			return err
		}
		if opt == "ban" && d.CountRemainingArgs() == 1 {
			if d.NextArg(); d.Val() == "off" {
				l.BanOff = true // the handler's ban does not apply here
				continue
			}
			d.Prev()
		}
		if ok, err := l.AbuseControls.unmarshalOption(d, opt, "limit "+l.Name); ok {
			if err != nil {
				return err
			}
			continue
		}
		val, err := oneArg(d, opt)
		if err != nil {
			return err
		}
		switch opt {
		case "key":
			l.Key = val
		case "missing":
			l.Missing = val
		case "max_in_flight":
			l.MaxInFlight, err = parseInt(d, "limit "+l.Name+" max_in_flight", val, 1)
		default:
			return d.Errf("unrecognized limit option %q: want key, missing, max_in_flight, count_status, cost, charge, ban or burst", opt)
		}
		if err != nil {
			return err
		}
	}
	rl.Limits = append(rl.Limits, l)
	return nil
}

// unmarshalPlan parses "plan <name> { max <n>|off; burst <n>; limit <name>
// <max>|off [burst <n>] }"; d is at the plan token. The values are checked
// with the rest of the handler's settings, in one place.
func (rl *RateLimit) unmarshalPlan(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.Errf("plan takes a name and a block (plan pro { max 1000 }), got none")
	}
	name := d.Val()
	if d.NextArg() {
		return d.Errf("plan %s takes a block, got %q", name, d.Val())
	}
	if _, dup := rl.Plans[name]; dup {
		return d.Errf("plan %s given twice", name)
	}
	var pc PlanConfig
	seen := options{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		what := "plan " + name + " " + opt
		switch opt {
		case "max", "burst":
			if err := seen.first(d, opt); err != nil {
				return err
			}
			val, err := oneArg(d, what)
			if err == nil {
				err = parsePlanValue(d, what, val, opt == "max", &pc.PlanLimit)
			}
			if err != nil {
				return err
			}
		case "max_in_flight":
			if err := seen.first(d, opt); err != nil {
				return err
			}
			val, err := oneArg(d, what)
			if err == nil {
				pc.MaxInFlight, err = parseInt(d, what, val, 1)
			}
			if err != nil {
				return err
			}
		case "limit":
			args := d.RemainingArgs()
			if len(args) != 2 && (len(args) != 4 || args[2] != "burst") {
				return d.Errf("%s takes a limit's name and its max or off, then optionally burst <n> (limit daily 5000), got %q", what, args)
			}
			if _, dup := pc.Limits[args[0]]; dup {
				return d.Errf("%s %s given twice", what, args[0])
			}
			var pl PlanLimit
			what += " " + args[0]
			if err := parsePlanValue(d, what, args[1], true, &pl); err != nil {
				return err
			}
			if len(args) == 4 {
				if err := parsePlanValue(d, what+" burst", args[3], false, &pl); err != nil {
					return err
				}
			}
			if pc.Limits == nil {
				pc.Limits = map[string]PlanLimit{}
			}
			pc.Limits[args[0]] = pl
		default:
			return d.Errf("unrecognized plan option %q: want max, burst, max_in_flight or limit", opt)
		}
	}
	if rl.Plans == nil {
		rl.Plans = map[string]PlanConfig{}
	}
	rl.Plans[name] = pc
	return nil
}

// parsePlanValue parses a plan's max (or, when !isMax, burst) for option
// what into pl: a whole number, or off for a max.
func parsePlanValue(d *caddyfile.Dispenser, what, val string, isMax bool, pl *PlanLimit) error {
	if isMax && val == "off" {
		pl.Off = true
		return nil
	}
	n, err := parseInt(d, what, val, 1)
	if isMax {
		pl.Max = n
	} else {
		pl.Burst = n
	}
	return err
}

// parseBan parses "ban <duration> [escalate [<longest>]]"; d is at the ban
// token. escalate without a longest ban escalates up to DefaultBanMax.
func parseBan(d *caddyfile.Dispenser) (ban, banMax caddy.Duration, err error) {
	args := d.RemainingArgs()
	if len(args) == 0 || len(args) > 3 || (len(args) > 1 && args[1] != "escalate") {
		return 0, 0, d.Errf("ban takes a duration, then optionally escalate and the longest ban (ban 10m escalate 24h), got %q", args)
	}
	if ban, err = parseDuration(d, "ban", args[0]); err != nil {
		return 0, 0, err
	}
	switch len(args) {
	case 2:
		banMax = caddy.Duration(DefaultBanMax)
		if ban >= banMax {
			return 0, 0, d.Errf("invalid ban %s escalate: the default longest ban is %s; name a longer one (ban %s escalate <longest>)", time.Duration(ban), DefaultBanMax, args[0])
		}
	case 3:
		if banMax, err = parseDuration(d, "ban escalate", args[2]); err != nil {
			return 0, 0, err
		}
	}
	return ban, banMax, nil
}

// parseCharge parses "charge <header> [estimate <n>] [hide]"; d is at the
// charge token, and what names the option in errors.
func parseCharge(d *caddyfile.Dispenser, what string) (*ChargeConfig, error) {
	args := d.RemainingArgs()
	if len(args) == 0 {
		return nil, d.Errf("%s takes a response header, then optionally estimate <units> and hide (charge X-Tokens-Used estimate 100 hide)", what)
	}
	c := &ChargeConfig{Header: args[0]}
	for i := 1; i < len(args); i++ {
		switch {
		case args[i] == "hide":
			c.Hide = true
		case args[i] == "estimate" && i+1 < len(args):
			i++
			c.Estimate = CostValue(args[i])
		default:
			return nil, d.Errf("%s: unknown argument %q, want estimate <units> or hide", what, args[i])
		}
	}
	return c, nil
}

// unmarshalStore parses "store memory" or "store redis { ... }"; d is at
// the store token.
func (rl *RateLimit) unmarshalStore(d *caddyfile.Dispenser) error {
	if !d.NextArg() {
		return d.ArgErr()
	}
	sc := &StoreConfig{Type: d.Val()}
	if d.NextArg() {
		return d.Errf("store takes one argument, got extra %q", d.Val())
	}
	switch sc.Type {
	case StoreMemory:
		if d.NextBlock(d.Nesting()) {
			return d.Errf("store memory takes no block, got %q", d.Val())
		}
		rl.Store = nil
		return nil
	case StoreRedis:
	default:
		return d.Errf("invalid store %q: must be memory or redis", sc.Type)
	}
	seen := options{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		if opt != "address" {
			if err := seen.first(d, opt); err != nil {
				return err
			}
		}
		switch opt {
		case "address":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			if slices.Contains(args, "") {
				return d.Err(`invalid address "": must be host:port`)
			}
			sc.Addresses = append(sc.Addresses, args...)
			continue
		case "tls":
			if d.NextArg() {
				return d.Errf("tls takes no argument, got %q", d.Val())
			}
			sc.TLS = true
			continue
		case "sync":
			args := d.RemainingArgs()
			if len(args) == 0 || len(args) > 2 {
				return d.Errf("sync takes an interval and optionally share or all, got %d arguments", len(args))
			}
			interval, err := parseDuration(d, opt, args[0])
			if err != nil {
				return err
			}
			sc.Sync = interval
			if len(args) == 2 {
				sc.SyncSpend = args[1]
			}
			continue
		}
		val, err := oneArg(d, opt)
		if err != nil {
			return err
		}
		switch opt {
		case "url":
			sc.URL = val
		case "master_name":
			sc.MasterName = val
		case "username":
			sc.Username = val
		case "password":
			sc.Password = val
		case "db":
			sc.DB, err = parseInt(d, opt, val, 0)
		case "key_prefix":
			sc.KeyPrefix = val
		case "timeout":
			sc.Timeout, err = parseDuration(d, opt, val)
		case "sync_timeout":
			sc.SyncTimeout, err = parseDuration(d, opt, val)
		case "on_error":
			sc.OnError = val
		case "hash_keys":
			sc.HashKeys = val
		case "pipeline":
			sc.Pipeline = val
		default:
			return d.Errf("unrecognized store redis option %q", opt)
		}
		if err != nil {
			return err
		}
	}
	if len(sc.Addresses) == 0 && sc.URL == "" {
		return d.Err("store redis needs an address or a url")
	}
	if len(sc.Addresses) > 0 && sc.URL != "" {
		// The url is not printed: it may hold a password.
		return d.Errf("store redis takes an address or a url, not both: got a url and address %q", sc.Addresses[0])
	}
	rl.Store = sc
	return nil
}

// secretOptions are the options whose values an error never prints.
var secretOptions = map[string]bool{"password": true, "hash_keys": true, "url": true}

// options records the options a block has given, so that one given twice
// is an error rather than "the last one wins".
type options map[string]string

// aliases maps each alias to the option it spells.
var aliases = map[string]string{
	"windowS":               "window",
	"maxTracked":            "max_tracked",
	"wsMaxConnectionsPerIp": "ws_max_connections_per_ip",
}

// first records opt (or the option it is an alias of) and fails if the
// block gave it already.
func (o options) first(d *caddyfile.Dispenser, opt string) error {
	name := opt
	if a, ok := aliases[opt]; ok {
		name = a
	}
	if prev, ok := o[name]; ok {
		if prev == opt {
			return d.Errf("option %s given twice", opt)
		}
		return d.Errf("option %s given twice (as %s and %s)", name, prev, opt)
	}
	o[name] = opt
	return nil
}

// oneArg returns the single argument of option opt, or an error if it has
// none, more than one, or an empty one: an explicitly empty value would
// otherwise silently mean the default.
func oneArg(d *caddyfile.Dispenser, opt string) (string, error) {
	if !d.NextArg() {
		return "", d.ArgErr()
	}
	val := d.Val()
	if d.NextArg() {
		if secretOptions[opt] {
			return "", d.Errf("%s takes one argument, got more (not printed: it may be a secret)", opt)
		}
		return "", d.Errf("%s takes one argument, got extra %q", opt, d.Val())
	}
	if val == "" {
		return "", d.Errf("invalid %s \"\": must not be empty", opt)
	}
	return val, nil
}

// parseInt parses a whole number of at least lowest for option opt (an
// explicit 0 where JSON's 0 is the default: lowest 1).
func parseInt(d *caddyfile.Dispenser, opt, val string, lowest int) (int, error) {
	return parseIntRule(d, opt, val, func(n int) error {
		if n < lowest {
			return fmt.Errorf("must be at least %d", lowest)
		}
		return nil
	})
}

// parseIntRule parses a whole number for option opt that rule (validate.go)
// accepts.
func parseIntRule(d *caddyfile.Dispenser, opt, val string, rule func(int) error) (int, error) {
	n, err := strconv.Atoi(val)
	if err != nil {
		return 0, d.Errf("invalid %s %q: not an integer", opt, val)
	}
	if err := rule(n); err != nil {
		return 0, d.Errf("invalid %s %q: %v", opt, val, err)
	}
	return n, nil
}

// parseDuration parses a positive duration such as "90s" or "5m" for option
// opt.
func parseDuration(d *caddyfile.Dispenser, opt, val string) (caddy.Duration, error) {
	dur, err := caddy.ParseDuration(val)
	if err != nil {
		return 0, d.Errf("invalid %s %q: %v", opt, val, err)
	}
	if dur <= 0 {
		return 0, d.Errf("invalid %s %q: must be positive", opt, val)
	}
	return caddy.Duration(dur), nil
}

// parseWindow parses a window: a bare integer of seconds, or, when
// durationOK, a duration such as "1m". It must be at least one second.
func parseWindow(d *caddyfile.Dispenser, opt, val string, durationOK bool) (caddy.Duration, error) {
	if secs, err := strconv.ParseInt(val, 10, 64); err == nil || errors.Is(err, strconv.ErrRange) {
		if rerr := windowSecondsRule(secs, err != nil); rerr != nil {
			return 0, d.Errf("invalid %s %q: %v", opt, val, rerr)
		}
		return caddy.Duration(time.Duration(secs) * MinWindow), nil
	}
	if !durationOK {
		return 0, d.Errf("invalid %s %q: must be a whole number of seconds", opt, val)
	}
	dur, err := parseDuration(d, opt, val)
	if err == nil && time.Duration(dur) < MinWindow {
		err = d.Errf("invalid %s %q: must be at least 1s", opt, val)
	}
	return dur, err
}

// Interface guards
var _ caddyfile.Unmarshaler = (*RateLimit)(nil)
