// Package keysfloor is a Caddy handler for bench/load only: it counts each
// client's requests in a sharded Go map, and does nothing else (no window,
// no headers, no refusal). Its throughput with many clients is the floor
// of any limiter in Caddy that keeps a count per client: what a table of
// that many keys costs (the map's memory, its cache misses, the collector's
// work) before any decision.
//
//	keys_floor
//
// The client is the X-Client header when the request has one, else the
// client IP as Caddy resolves it (trusted_proxies), as bench/load's
// scenarios name them.
package keysfloor

import (
	"hash/maphash"
	"net/http"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(Floor{})
	httpcaddyfile.RegisterHandlerDirective("keys_floor", func(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
		f := new(Floor)
		return f, f.UnmarshalCaddyfile(h.Dispenser)
	})
	httpcaddyfile.RegisterDirectiveOrder("keys_floor", httpcaddyfile.Before, "respond")
}

// numShards is how many locks the keys are spread over, as the memory store's.
const numShards = 64

// Floor counts requests per client and passes every request on.
type Floor struct {
	seed   maphash.Seed
	shards *[numShards]shard
}

type shard struct {
	mu sync.Mutex
	m  map[string]uint64
}

// CaddyModule returns the Caddy module information.
func (Floor) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: "http.handlers.keys_floor", New: func() caddy.Module { return new(Floor) }}
}

// Provision makes the maps.
func (f *Floor) Provision(caddy.Context) error {
	f.seed, f.shards = maphash.MakeSeed(), new([numShards]shard)
	for i := range f.shards {
		f.shards[i].m = make(map[string]uint64)
	}
	return nil
}

// ServeHTTP counts the request against its client and passes it on. The
// key is stored as net/http parsed it: one string per header value
// already, so nothing is copied.
func (f *Floor) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	key := r.Header.Get("X-Client")
	if key == "" {
		key, _ = caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string)
	}
	sh := &f.shards[maphash.String(f.seed, key)%numShards]
	sh.mu.Lock()
	sh.m[key]++
	sh.mu.Unlock()
	return next.ServeHTTP(w, r)
}

// UnmarshalCaddyfile reads keys_floor, which takes no arguments.
func (f *Floor) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next()
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
