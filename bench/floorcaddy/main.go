// Command floorcaddy is Caddy with the rate_limit module and, for bench/load
// only, the redis_floor, quota_floor and keys_floor handlers
// (bench/redisfloor, bench/headerfloor, bench/keysfloor).
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-rate-limit/caddy-rate-limit"
	_ "github.com/caddy-rate-limit/caddy-rate-limit/bench/headerfloor"
	_ "github.com/caddy-rate-limit/caddy-rate-limit/bench/keysfloor"
	_ "github.com/caddy-rate-limit/caddy-rate-limit/bench/redisfloor"
)

func main() {
	caddycmd.Main()
}
