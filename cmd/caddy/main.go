// Command caddy is Caddy with the standard modules and the rate_limit handler,
// for running and testing this module with go run.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/caddy-rate-limit/caddy-rate-limit"
)

func main() {
	caddycmd.Main()
}
