package ratelimit

import (
	"context"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Behind a proxy Caddy trusts, the client IP comes from a header such as
// X-Forwarded-For, and unless the server sets trusted_proxies_strict Caddy
// takes its leftmost address: the one the client wrote, if it sent the
// header. A client then chooses its own key, a new one per request, and the
// limit stops limiting exactly the clients who know it. This file notices
// that setup from the traffic and says so, once per server, in the log and
// on the zone.
//
// A handler cannot see the server's trusted ranges (Caddy loads them into
// an unexported field), but when it is provisioned it sees the server's
// other settings, and per request whether the peer was a trusted proxy.

// spoofableKeyMsg is the warning's message, logged once per server.
const spoofableKeyMsg = "clients behind a trusted proxy choose their own rate limit key: " +
	"without trusted_proxies_strict, Caddy takes the client IP from the leftmost address of a list header, which the client writes"

// spoofableKeyFix is the whole fix, as the warning gives it.
const spoofableKeyFix = "set trusted_proxies_strict in the server's options, and list in trusted_proxies every proxy in front of Caddy " +
	"(a CDN's ranges and the load balancer both): strict mode takes the rightmost address that is not a trusted proxy, " +
	"so with a hop left out every client behind it is counted as that hop's one address"

// singleValueIPHeaders are the client IP headers, canonical, that the
// proxies setting them fill with the one address they saw, replacing any
// value the client sent: in them there is no leftmost entry for a client to
// write. Any other header, X-Forwarded-For and Forwarded first, is taken to
// hold a list that proxies append to: a header this module does not know
// may be one, and a needless warning costs a log line where a missed one
// costs the limit.
var singleValueIPHeaders = map[string]bool{
	"X-Real-Ip":        true, // nginx's proxy_set_header X-Real-IP $remote_addr, Traefik
	"Cf-Connecting-Ip": true, // Cloudflare
	"True-Client-Ip":   true, // Akamai, Cloudflare Enterprise
	"Fly-Client-Ip":    true, // Fly.io
}

// listIPHeaders returns the client IP headers of srv in which a client can
// write the address Caddy takes: its list headers, while
// trusted_proxies_strict is off. It returns nil when a client cannot choose
// its client IP that way: no server, strict on, or single-value headers
// only.
func listIPHeaders(srv *caddyhttp.Server) []string {
	if srv == nil || srv.TrustedProxiesStrict > 0 {
		return nil
	}
	headers := srv.ClientIPHeaders
	if len(headers) == 0 {
		headers = []string{"X-Forwarded-For"} // Caddy's default
	}
	var list []string
	for _, h := range headers {
		if !singleValueIPHeaders[textproto.CanonicalMIMEHeaderKey(h)] {
			list = append(list, h)
		}
	}
	return list
}

// ipUses returns what of the handler goes by the client IP: each limit
// whose key is the client IP, holds it, or falls back to it (missing ip),
// exempt, and ws_max_connections_per_ip, which counts by the first limit's
// key.
func (rl *RateLimit) ipUses() []string {
	var uses []string
	for i := range rl.policies {
		if rl.policies[i].usesClientIP() {
			uses = append(uses, "limit "+rl.policies[i].name)
		}
	}
	if len(rl.exemptRanges) > 0 {
		uses = append(uses, "exempt")
	}
	if rl.WSMaxConnectionsPerIP > 0 && rl.policies[0].usesClientIP() {
		uses = append(uses, "ws_max_connections_per_ip")
	}
	return uses
}

// usesClientIP reports whether the limit's key is, holds or may fall back
// to the client IP.
func (p *policy) usesClientIP() bool {
	return p.key == "" || p.missing == MissingIP ||
		strings.Contains(p.key, "{client_ip}") || strings.Contains(p.key, "{http.vars.client_ip}")
}

// proxyWatch is what a handler whose key a client behind a trusted proxy
// could choose keeps to notice it: nil in a handler whose key no client can
// choose that way. It is safe for concurrent use.
type proxyWatch struct {
	// seen is set at the first request that came through a trusted proxy:
	// the zone is marked, and later requests are not looked at.
	seen    atomic.Bool
	server  *serverWarning
	headers []string // the server's list headers
	uses    []string // what of the handler goes by the client IP
}

// serverWarning is the warning of one server, shared by its handlers, so
// that it is logged once whichever of them sees a proxied request first.
type serverWarning struct {
	name   string
	logged atomic.Bool
}

// serverWarnings holds the warning of every server of a loaded config
// (*caddyhttp.Server → *serverWarning); an entry goes when its config's
// context ends. A reload makes new servers, so a config that still trusts
// the leftmost address is warned about again.
var serverWarnings sync.Map

// watchProxy sets up the handler's proxyWatch for the server it is
// provisioned in (found in ctx), or none when no client can choose its key.
func (rl *RateLimit) watchProxy(ctx caddy.Context) {
	rl.proxy = nil
	srv, _ := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	headers := listIPHeaders(srv)
	if len(headers) == 0 {
		return
	}
	uses := rl.ipUses()
	if len(uses) == 0 {
		return
	}
	sw, loaded := serverWarnings.LoadOrStore(srv, &serverWarning{name: srv.Name()})
	if !loaded {
		context.AfterFunc(ctx, func() { serverWarnings.Delete(srv) })
	}
	rl.proxy = &proxyWatch{server: sw.(*serverWarning), headers: headers, uses: uses}
}

// fromPeer reports whether client IP ip is the address of the peer, whose
// address and port are remoteAddr: then the client did not choose it, and
// the request need not be asked whether it came through a trusted proxy.
// Asking costs a look-up in the request's variables; this compare spares
// it to every request a server that trusts no proxy gets. An address written otherwise than
// Caddy writes it only costs the look-up.
func fromPeer(remoteAddr, ip string) bool {
	n := len(ip)
	if len(remoteAddr) > 0 && remoteAddr[0] == '[' { // [IPv6]:port
		return len(remoteAddr) > n+2 && remoteAddr[1:n+1] == ip && remoteAddr[n+1] == ']' && remoteAddr[n+2] == ':'
	}
	return len(remoteAddr) > n && remoteAddr[:n] == ip && remoteAddr[n] == ':'
}

// noticeProxy marks the zone, and logs the server's warning unless one of
// its handlers has, if the request whose variables are vars came through
// a trusted proxy. The caller has checked that rl.proxy has seen none yet.
func (rl *RateLimit) noticeProxy(vars map[string]any) {
	if trusted, _ := vars[caddyhttp.TrustedProxyVarKey].(bool); !trusted {
		return
	}
	pw := rl.proxy
	if !pw.seen.CompareAndSwap(false, true) {
		return
	}
	rl.zone.markSpoofable(rl.holdID)
	if !pw.server.logged.CompareAndSwap(false, true) {
		return
	}
	if c := rl.logger.Check(zapcore.WarnLevel, spoofableKeyMsg); c != nil {
		c.Write(
			zap.String("server", pw.server.name),
			zap.String("zone", rl.Zone),
			zap.Strings("client_ip_headers", pw.headers),
			zap.Strings("client_ip_used_by", pw.uses),
			zap.String("fix", spoofableKeyFix),
		)
	}
}
