// Package headerfloor is a Caddy handler for bench/load only: it sets the
// quota headers the rate_limit handler sets by default, with values of the
// same lengths, and decides nothing. Admitting, it passes the request on;
// with refuse, it answers 429 with Retry-After as well, as the rate_limit
// handler refuses when the server has no handle_errors. Its throughput is
// the floor of any limiter in Caddy that sends those headers: what the
// headers cost Caddy, net/http and the client before any decision.
//
//	quota_floor [refuse]
package headerfloor

import (
	"net/http"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(Floor{})
	httpcaddyfile.RegisterHandlerDirective("quota_floor", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		f := new(Floor)
		return f, f.UnmarshalCaddyfile(h.Dispenser)
	})
	httpcaddyfile.RegisterDirectiveOrder("quota_floor", httpcaddyfile.Before, "respond")
}

// Floor sets constant quota headers and passes the request on, or refuses it.
type Floor struct {
	// Refuse answers every request 429 with Retry-After, as a refusal of
	// the rate_limit handler with max 1.
	Refuse bool `json:"refuse,omitempty"`

	limit, remaining, reset, retryAfter []string
}

// CaddyModule returns the Caddy module information.
func (Floor) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.quota_floor", New: func() caddy.Module { return new(Floor) }}
}

// Provision builds the header values once: the lengths of the rate_limit
// handler's values in bench/load's scenarios (max 1000000000 admitting,
// max 1 refusing; the reset as Unix seconds).
func (f *Floor) Provision(caddy.Context) error {
	f.limit, f.remaining = []string{"1000000000"}, []string{"999999999"}
	if f.Refuse {
		f.limit, f.remaining = []string{"1"}, []string{"0"}
	}
	f.reset = []string{strconv.FormatInt(time.Now().Add(time.Minute).Unix(), 10)}
	f.retryAfter = []string{"60"}
	return nil
}

// ServeHTTP sets the headers, as the rate_limit handler does (canonical
// keys, no allocation), and passes the request on or refuses it.
func (f *Floor) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	h := w.Header()
	h["X-Ratelimit-Limit"] = f.limit
	h["X-Ratelimit-Remaining"] = f.remaining
	h["X-Ratelimit-Reset"] = f.reset
	if !f.Refuse {
		return next.ServeHTTP(w, r)
	}
	h["Retry-After"] = f.retryAfter
	w.WriteHeader(http.StatusTooManyRequests)
	return nil
}

// UnmarshalCaddyfile reads quota_floor [refuse].
func (f *Floor) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if d.NextArg() {
		if d.Val() != "refuse" {
			return d.Errf("unknown argument %q: want refuse", d.Val())
		}
		f.Refuse = true
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Floor)(nil)
	_ caddyhttp.MiddlewareHandler = (*Floor)(nil)
	_ caddyfile.Unmarshaler       = (*Floor)(nil)
)
