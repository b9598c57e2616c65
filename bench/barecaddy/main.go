// Command barecaddy is Caddy with the standard modules and without the
// rate_limit handler: the baseline of the load runs (bench/load.sh).
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

func main() {
	caddycmd.Main()
}
