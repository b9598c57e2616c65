package ratelimit

import (
	"bufio"
	"context"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/coder/websocket"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/net/http/httpguts"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// WebSocket refusal modes: how a handshake over the rate or over the
// connection cap is turned away.
const (
	// WSRejectClose completes the handshake and closes the socket at once
	// with status 1013 Try Again Later (RFC 6455 §7.4.1), a code browser
	// clients can act on. Where the connection cannot be taken over (HTTP/2
	// or HTTP/3 extended CONNECT) the refusal is a 429 instead.
	WSRejectClose = "close"
	// WSRejectStatus refuses with a plain 429 Too Many Requests and the usual
	// headers, as for any other request.
	WSRejectStatus = "status"
)

// wsCloseReason is the reason sent with the 1013 close frame.
const wsCloseReason = "Try Again Later"

// wsRefusalGrace bounds how long a refused WebSocket holds its goroutine and
// connection: the 1013 close frame must be written and the peer's close read
// within it. The library's own close handshake waits up to 5 s for each, which
// a flood of peers that never answer would turn into piles of goroutines.
const wsRefusalGrace = time.Second

// wsCapRetryAfter is the Retry-After, in seconds, of a 429 for a handshake
// over the connection cap: a slot frees whenever one of the key's sockets
// ends, which no clock predicts.
const wsCapRetryAfter = "1"

// isWebSocket reports whether r opens a WebSocket: an HTTP/1.1 upgrade
// (Connection: upgrade and Upgrade: websocket, as Caddy's reverse proxy
// detects it) or an HTTP/2 or HTTP/3 extended CONNECT for the websocket
// protocol (RFC 8441, RFC 9220).
func isWebSocket(r *http.Request) bool {
	if r.ProtoMajor < 2 {
		return httpguts.HeaderValuesContainsToken(r.Header["Connection"], "upgrade") &&
			httpguts.HeaderValuesContainsToken(r.Header["Upgrade"], "websocket")
	}
	return r.Method == http.MethodConnect &&
		(r.Header.Get(":protocol") == "websocket" || r.Proto == "websocket")
}

// serveWebSocket passes an admitted WebSocket handshake (or one a dry run
// lets through: allowed false) on, holding one of the key's connection
// slots for as long as next serves the socket (for reverse_proxy, until the
// tunnel ends however it ends), or refuses it when the key already has
// WSMaxConnectionsPerIP sockets open: in this process, or on a Redis zone
// across every instance sharing the Redis (a lease per socket).
// st is the request's state: a refusal for the cap marks its placeholders
// exceeded.
func (rl *RateLimit) serveWebSocket(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, st *requestState, key string, v limiter.Verdict, allowed bool) error {
	z := rl.zone
	localCap := rl.WSMaxConnectionsPerIP
	var lease limiter.Lease
	leased, ok := false, true
	fleet, isFleet := z.fleet()
	if isFleet && localCap > 0 {
		var err error
		if fleet.Degraded() {
			err = limiter.ErrRedisDegraded // decided without waiting on Redis, as Decide does
		} else {
			var got bool
			lease, got, err = fleet.AcquireLease(r.Context(), key, localCap, time.Duration(rl.WSLeaseTTL))
			leased, ok = err == nil && got, err != nil || got
		}
		switch {
		case err == nil:
			localCap = 0 // the fleet counts it; this process only tracks it
		case fleet.OnError() == limiter.OnErrorAllow:
			localCap = 0
		case fleet.OnError() == limiter.OnErrorDeny && !rl.DryRun:
			z.count(resultDegradedDenied)
			w.Header().Set("Retry-After", "1")
			return caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("rate limit zone %q: websocket lease: %w", rl.Zone, err))
		default:
			// on_error local: the cap falls back to this process.
		}
	}
	var release func()
	if ok {
		release, ok = z.wsAcquire(key, localCap)
	}
	if !ok && rl.DryRun {
		// A dry run refuses nothing: the socket goes through, uncapped,
		// and counts as what would have been refused.
		z.count(resultDryRun)
		return next.ServeHTTP(w, r)
	}
	if !ok {
		z.count(resultLimited)
		if c := rl.logger.Check(zapcore.DebugLevel, "websocket connection limit reached"); c != nil {
			c.Write(
				zap.String("zone", rl.Zone),
				zap.String("key", key),
				zap.Int("ws_max_connections_per_ip", rl.WSMaxConnectionsPerIP),
			)
		}
		// Refused by this handler, if for the cap rather than the rate, so
		// handle_errors renders it like any refusal.
		st.exceeded = true
		w.Header().Set("Retry-After", wsCapRetryAfter)
		if rl.refuseWebSocket(w, r) {
			return nil
		}
		return caddyhttp.Error(rl.Status,
			fmt.Errorf("websocket connection limit reached: key %s in zone %q has %d open", key, rl.Zone, rl.WSMaxConnectionsPerIP))
	}
	defer release()
	if leased {
		defer rl.keepLease(fleet, lease)()
	}
	z.countVerdict(allowed, v.StoreError, rl.DryRun) // not allowed: a dry run lets it through
	return next.ServeHTTP(w, r)
}

// keepLease renews l, a lease of fleet, every third of its time to live
// until the returned function is called, which gives it back.
func (rl *RateLimit) keepLease(fleet limiter.Fleet, l limiter.Lease) (stop func()) {
	ttl := time.Duration(rl.WSLeaseTTL)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := rl.zone.clock.NewTicker(ttl / 3)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C():
				lost, err := fleet.RenewLease(ctx, l, ttl)
				switch {
				case err != nil && ctx.Err() == nil:
					rl.logger.Debug("renewing a websocket lease", zap.String("zone", rl.Zone), zap.Error(err))
				case lost:
					rl.logger.Info("a websocket lease lost in redis was taken again", zap.String("zone", rl.Zone))
				}
			}
		}
	}()
	return func() {
		cancel()
		<-done
		// Given back; if Redis does not answer, it lapses by itself.
		if err := fleet.ReleaseLease(context.Background(), l); err != nil {
			rl.logger.Debug("giving back a websocket lease", zap.String("zone", rl.Zone), zap.Error(err))
		}
	}
}

// refuseWebSocket turns a WebSocket handshake away with a close 1013 Try
// Again Later when the handler is set to, and the connection can be taken
// over. It reports whether it did so; if not, the caller refuses with 429.
// The quota headers already set on w go out on the 101 response. A peer that
// does not answer the close is dropped after wsRefusalGrace.
func (rl *RateLimit) refuseWebSocket(w http.ResponseWriter, r *http.Request) bool {
	if rl.WSReject == WSRejectStatus || !canTakeOver(w, r) {
		return false
	}
	c, err := websocket.Accept(graceWriter{w}, r, &websocket.AcceptOptions{
		// The refusal only closes: any origin may be told to come back
		// later, and the subprotocol the client asked for is echoed so
		// that browsers, which fail a handshake answered without one,
		// see the close code.
		InsecureSkipVerify: true,
		Subprotocols:       requestedSubprotocols(r),
	})
	if err != nil {
		// Accept has written an error response, or the connection is
		// gone; either way nothing more can be sent.
		if c := rl.logger.Check(zapcore.DebugLevel, "refusing websocket"); c != nil {
			c.Write(zap.String("zone", rl.Zone), zap.Error(err))
		}
		return true
	}
	if err := c.Close(websocket.StatusTryAgainLater, wsCloseReason); err != nil {
		if c := rl.logger.Check(zapcore.DebugLevel, "closing refused websocket"); c != nil {
			c.Write(zap.String("zone", rl.Zone), zap.Error(err))
		}
	}
	return true
}

// graceWriter is the ResponseWriter a refusal hands to websocket.Accept: the
// connection it hijacks gets a deadline wsRefusalGrace away, so that Close
// gives up on a peer that does not answer. The deadline is set after the
// hijack, which clears the server's deadlines; coder/websocket sets none of
// its own on the connection.
type graceWriter struct {
	http.ResponseWriter
}

// Hijack takes the connection over through Caddy's ResponseWriter wrappers, as
// websocket.Accept would, and sets its deadline.
func (w graceWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	conn, brw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err != nil {
		return nil, nil, err
	}
	if err := conn.SetDeadline(time.Now().Add(wsRefusalGrace)); err != nil {
		conn.Close()
		return nil, nil, fmt.Errorf("bounding the refused websocket: %w", err)
	}
	return conn, brw, nil
}

// canTakeOver reports whether a handshake can be completed and closed here:
// an HTTP/1.1 GET with a well-formed version 13 handshake over a connection
// that can be hijacked through Caddy's ResponseWriter wrappers. Anything else
// (HTTP/2 or HTTP/3 extended CONNECT, a malformed handshake) is refused with
// a 429 rather than the 4xx websocket.Accept would answer.
func canTakeOver(w http.ResponseWriter, r *http.Request) bool {
	if r.ProtoMajor != 1 || !r.ProtoAtLeast(1, 1) || r.Method != http.MethodGet ||
		r.Header.Get("Sec-WebSocket-Version") != "13" {
		return false
	}
	keys := r.Header.Values("Sec-WebSocket-Key")
	if len(keys) != 1 {
		return false
	}
	if k, err := base64.StdEncoding.DecodeString(strings.TrimSpace(keys[0])); err != nil || len(k) != 16 {
		return false
	}
	for {
		switch rw := w.(type) {
		case http.Hijacker:
			return true
		case interface{ Unwrap() http.ResponseWriter }:
			w = rw.Unwrap()
		default:
			return false
		}
	}
}

// requestedSubprotocols lists the subprotocols the client offered in
// Sec-WebSocket-Protocol, in its order.
func requestedSubprotocols(r *http.Request) []string {
	var protos []string
	for _, v := range r.Header.Values("Sec-WebSocket-Protocol") {
		for p := range strings.SplitSeq(v, ",") {
			if p = strings.TrimSpace(p); p != "" {
				protos = append(protos, p)
			}
		}
	}
	return protos
}

// Interface guards
var _ http.Hijacker = graceWriter{}
