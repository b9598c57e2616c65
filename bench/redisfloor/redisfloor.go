// Package redisfloor is a Caddy handler for bench/load only: each request
// makes one round trip to Redis, as the rate_limit handler's Redis store
// does (EVALSHA with one key, through go-redis's auto-pipeliner or one call
// at a time), but runs the cheapest script there is (return 1) and decides
// nothing. Its throughput is the floor of any limiter in Caddy that asks
// Redis once per request on the same machine.
//
//	redis_floor <host:port> [pipeline]
package redisfloor

import (
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
)

func init() {
	caddy.RegisterModule(Floor{})
	httpcaddyfile.RegisterHandlerDirective("redis_floor", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		f := new(Floor)
		return f, f.UnmarshalCaddyfile(h.Dispenser)
	})
	httpcaddyfile.RegisterDirectiveOrder("redis_floor", httpcaddyfile.Before, "respond")
}

// Floor asks Redis once per request and passes it on.
type Floor struct {
	// Address is the redis-server's host:port.
	Address string `json:"address"`
	// Pipeline sends the calls through go-redis's auto-pipeliner, as the
	// rate_limit store's pipeline on does.
	Pipeline bool `json:"pipeline,omitempty"`

	client *redis.Client
	pipe   *redis.AutoPipeliner
	hash   any
}

// CaddyModule returns the Caddy module information.
func (Floor) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.redis_floor", New: func() caddy.Module { return new(Floor) }}
}

// Provision connects to Redis and loads the script.
func (f *Floor) Provision(ctx caddy.Context) error {
	// As the rate_limit store's client: no retries, the context's deadline
	// on the socket.
	f.client = redis.NewClient(&redis.Options{Addr: f.Address, MaxRetries: -1, ContextTimeoutEnabled: true})
	script := redis.NewScript("return 1")
	if err := script.Load(ctx, f.client).Err(); err != nil {
		return err
	}
	f.hash = script.Hash()
	if f.Pipeline {
		cfg := redis.DefaultAutoPipelineOptions()
		cfg.MaxQueuedCommands = 10_000
		ap, err := f.client.AsyncAutoPipelineWithOptions(cfg)
		if err != nil {
			return err
		}
		f.pipe = ap
	}
	return nil
}

// Cleanup closes the client.
func (f *Floor) Cleanup() error {
	if f.pipe != nil {
		_ = f.pipe.Close()
	}
	return f.client.Close()
}

// ServeHTTP runs the script once, keyed by the X-Client header, and passes
// the request on; a failed call is a 503.
func (f *Floor) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	ctx := r.Context()
	cmd := redis.NewCmd(ctx, "evalsha", f.hash, 1, r.Header.Get("X-Client"))
	var err error
	if f.pipe != nil {
		err = f.pipe.Submit(ctx, cmd).WaitContext(ctx)
	} else {
		err = f.client.Process(ctx, cmd)
	}
	if err != nil {
		return caddyhttp.Error(http.StatusServiceUnavailable, err)
	}
	return next.ServeHTTP(w, r)
}

// UnmarshalCaddyfile reads redis_floor <host:port> [pipeline].
func (f *Floor) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
	if !d.NextArg() {
		return d.ArgErr()
	}
	f.Address = d.Val()
	if d.NextArg() {
		if d.Val() != "pipeline" {
			return d.Errf("unknown argument %q: want pipeline", d.Val())
		}
		f.Pipeline = true
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Floor)(nil)
	_ caddy.CleanerUpper          = (*Floor)(nil)
	_ caddyhttp.MiddlewareHandler = (*Floor)(nil)
	_ caddyfile.Unmarshaler       = (*Floor)(nil)
)
