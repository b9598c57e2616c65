package tests

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/coder/websocket"
)

// echoBackend is a real WebSocket server that sends every message back, and
// closes the socket on "bye".
type echoBackend struct {
	*httptest.Server
	open atomic.Int64 // sockets the backend has open
}

// startEchoBackend starts an echo backend that is stopped when t ends.
func startEchoBackend(t *testing.T) *echoBackend {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	b := new(echoBackend)
	b.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		c, err := websocket.Accept(w, r, &websocket.AcceptOptions{Subprotocols: []string{"chat"}})
		if err != nil {
			return
		}
		b.open.Add(1)
		defer b.open.Add(-1)
		defer c.CloseNow()
		for {
			typ, msg, err := c.Read(ctx)
			if err != nil {
				return
			}
			if string(msg) == "bye" {
				c.Close(websocket.StatusNormalClosure, "bye")
				return
			}
			if err := c.Write(ctx, typ, msg); err != nil {
				return
			}
		}
	}))
	// The handlers block on Read; cancel them before Close waits for them.
	t.Cleanup(func() { cancel(); b.Close() })
	return b
}

// hostPort is the backend's address, for reverse_proxy.
func (b *echoBackend) hostPort() string {
	return strings.TrimPrefix(b.URL, "http://")
}

// wsURL is the WebSocket URL of path on the site.
func (s *server) wsURL(path string) string {
	return "ws" + strings.TrimPrefix(s.Base, "http") + path
}

// dialWS opens a WebSocket to path through Caddy. It returns the handshake
// response even when the handshake fails.
func (s *server) dialWS(path string, opts *websocket.DialOptions) (*websocket.Conn, *http.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return websocket.Dial(ctx, s.wsURL(path), opts)
}

// mustDialWS opens a WebSocket to path and fails the test if it cannot.
func (s *server) mustDialWS(path string) (*websocket.Conn, *http.Response) {
	s.t.Helper()
	c, resp, err := s.dialWS(path, nil)
	if err != nil {
		s.t.Fatalf("dialing %s: %v", path, err)
	}
	return c, resp
}

// wantEcho fails the test unless c sends msg back.
func wantEcho(t *testing.T, c *websocket.Conn, msg string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
		t.Fatalf("writing %q: %v", msg, err)
	}
	_, got, err := c.Read(ctx)
	if err != nil {
		t.Fatalf("reading the echo of %q: %v", msg, err)
	}
	if string(got) != msg {
		t.Fatalf("echo = %q, want %q", got, msg)
	}
}

// closeStatus reads from c until it fails and returns the close status the
// server sent (-1 if the socket ended without a close frame) and its reason.
func closeStatus(t *testing.T, c *websocket.Conn) (websocket.StatusCode, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	defer c.CloseNow()
	for {
		_, msg, err := c.Read(ctx)
		if err == nil {
			t.Errorf("unexpected message %q before the close", msg)
			continue
		}
		var ce websocket.CloseError
		if errors.As(err, &ce) {
			return ce.Code, ce.Reason
		}
		if ctx.Err() != nil {
			t.Fatalf("socket still open after 10s, want it closed: %v", err)
		}
		return -1, err.Error()
	}
}

// wantTryAgainLater fails the test unless the handshake to path succeeds and
// the socket is closed at once with 1013 Try Again Later.
func (s *server) wantTryAgainLater(path string, opts *websocket.DialOptions) *http.Response {
	s.t.Helper()
	c, resp, err := s.dialWS(path, opts)
	if err != nil {
		s.t.Fatalf("dialing %s: handshake failed (%v), want it completed and closed with 1013", path, err)
	}
	code, reason := closeStatus(s.t, c)
	if code != websocket.StatusTryAgainLater || reason != "Try Again Later" {
		s.t.Fatalf("close = %d %q, want 1013 %q", code, reason, "Try Again Later")
	}
	return resp
}

// wsSite is a site that limits with the given rate_limit options and proxies
// to backend.
func wsSite(backend *echoBackend, options, proxyOptions string) string {
	return fmt.Sprintf(`
:$PORT {
	rate_limit {
		%s
	}
	reverse_proxy %s {
		%s
	}
}`, options, backend.hostPort(), proxyOptions)
}

// An admitted socket echoes through Caddy, and its 101 carries the quota
// headers; the handshake counted against the window.
func TestWebSocketAdmittedEchoes(t *testing.T) {
	backend := startEchoBackend(t)
	s := startCaddy(t, "", wsSite(backend, `
		zone ws_echo
		window 60
		max 10
		ws_max_connections_per_ip 2`, ""))

	c, resp := s.mustDialWS("/")
	defer c.Close(websocket.StatusNormalClosure, "")
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("status = %d, want 101", resp.StatusCode)
	}
	wantHeader(t, resp, "X-RateLimit-Limit", "10")
	wantHeader(t, resp, "X-RateLimit-Remaining", "9")
	for i := range 5 {
		wantEcho(t, c, "hello "+strconv.Itoa(i))
	}
	// Messages on an open socket are not requests: the next request sees
	// the handshake as the only one counted.
	resp, _ = s.get("/")
	wantHeader(t, resp, "X-RateLimit-Remaining", "8")
}

// Over ws_max_connections_per_ip, the handshake completes and the socket is
// closed with 1013, whatever its origin and subprotocol; when a socket ends,
// its slot is free again.
func TestWebSocketOverCapCloses1013(t *testing.T) {
	backend := startEchoBackend(t)
	s := startCaddy(t, "", wsSite(backend, `
		zone ws_cap
		window 60
		max 1000
		ws_max_connections_per_ip 2`, ""))

	a, _ := s.mustDialWS("/")
	wantEcho(t, a, "a")
	b, _ := s.mustDialWS("/")
	wantEcho(t, b, "b")

	resp := s.wantTryAgainLater("/", nil)
	wantHeader(t, resp, "X-RateLimit-Limit", "1000")
	// A browser on another origin asking for a subprotocol still gets the
	// close code: the refusal accepts any origin and echoes the protocol.
	opts := &websocket.DialOptions{
		HTTPHeader:   http.Header{"Origin": {"https://elsewhere.example"}},
		Subprotocols: []string{"chat"},
	}
	resp = s.wantTryAgainLater("/", opts)
	wantHeader(t, resp, "Sec-WebSocket-Protocol", "chat")

	// Plain requests are not capped.
	resp, _ = s.get("/")
	if resp.StatusCode == http.StatusTooManyRequests {
		t.Fatalf("plain GET refused with 429 while only the socket cap is reached")
	}

	if err := a.Close(websocket.StatusNormalClosure, ""); err != nil {
		t.Fatalf("closing a: %v", err)
	}
	c := s.dialUntilAdmitted("/")
	wantEcho(t, c, "c")
	wantEcho(t, b, "b again")
	s.wantTryAgainLater("/", nil)
	b.CloseNow()
	c.CloseNow()
}

// dialUntilAdmitted dials path until a socket is admitted and echoes, for
// the moment a slot takes to come back after a socket ends; a slot that never
// comes back fails the test.
func (s *server) dialUntilAdmitted(path string) *websocket.Conn {
	s.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		c, _, err := s.dialWS(path, nil)
		if err != nil {
			s.t.Fatalf("dialing %s: %v", path, err)
		}
		if echoes(c) {
			return c
		}
		c.CloseNow()
		if time.Now().After(deadline) {
			s.t.Fatalf("no socket admitted on %s for 5s: a slot was not given back", path)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// echoes reports whether c sends a message back rather than closing.
func echoes(c *websocket.Conn) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Write(ctx, websocket.MessageText, []byte("probe")); err != nil {
		return false
	}
	_, msg, err := c.Read(ctx)
	return err == nil && string(msg) == "probe"
}

// A handshake is a request: it counts against the window with plain
// requests, and one over the rate is closed with 1013.
func TestWebSocketOverRateCloses1013(t *testing.T) {
	backend := startEchoBackend(t)
	s := startCaddy(t, "", wsSite(backend, `
		zone ws_rate
		window 60
		max 3`, ""))

	resp, _ := s.get("/") // 1
	wantHeader(t, resp, "X-RateLimit-Remaining", "2")
	a, _ := s.mustDialWS("/") // 2
	wantEcho(t, a, "a")
	b, resp := s.mustDialWS("/") // 3
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	wantEcho(t, b, "b")

	resp = s.wantTryAgainLater("/", nil)
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 1 || ra > 60 {
		t.Errorf("Retry-After = %q, want 1..60", resp.Header.Get("Retry-After"))
	}
	resp, _ = s.get("/")
	wantStatus(t, resp, http.StatusTooManyRequests)

	// Sockets admitted earlier stay up.
	wantEcho(t, a, "a again")
	a.CloseNow()
	b.CloseNow()
}

// With ws_reject status, refusals are plain 429s with the usual headers.
func TestWebSocketRejectStatus(t *testing.T) {
	backend := startEchoBackend(t)
	s := startCaddy(t, "", wsSite(backend, `
		zone ws_status
		window 60
		max 3
		ws_max_connections_per_ip 1
		ws_reject status`, ""))

	a, _ := s.mustDialWS("/") // 1
	wantEcho(t, a, "a")

	_, resp, err := s.dialWS("/", nil) // 2: over the cap
	if err == nil || resp == nil {
		t.Fatalf("handshake over the cap: err = %v, want a failed handshake with a response", err)
	}
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "X-RateLimit-Limit", "3")
	wantHeader(t, resp, "X-RateLimit-Remaining", "1")
	wantHeader(t, resp, "Retry-After", "1")

	// A handshake refused for the cap was still a request in the window.
	_, resp, _ = s.dialWS("/", nil) // 3: over the cap
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")

	_, resp, err = s.dialWS("/", nil) // 4: over the rate
	if err == nil || resp == nil {
		t.Fatalf("handshake over the rate: err = %v, want a failed handshake with a response", err)
	}
	wantStatus(t, resp, http.StatusTooManyRequests)
	wantHeader(t, resp, "X-RateLimit-Limit", "3")
	wantHeader(t, resp, "X-RateLimit-Remaining", "0")
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 2 || ra > 60 {
		t.Errorf("Retry-After = %q, want the rest of the window (2..60)", resp.Header.Get("Retry-After"))
	}
	wantEcho(t, a, "a still up")
	a.CloseNow()
}

// The live counts belong to the zone, not the config: sockets opened before
// a reload still hold their slots under the new config.
func TestWebSocketLiveCountSurvivesReload(t *testing.T) {
	backend := startEchoBackend(t)
	site := func(max int) string {
		return wsSite(backend, fmt.Sprintf(`
		zone ws_reload
		window 60
		max %d
		ws_max_connections_per_ip 2`, max), "stream_close_delay 1m")
	}
	s := startCaddy(t, "", site(1000))
	a, _ := s.mustDialWS("/")
	b, _ := s.mustDialWS("/")
	wantEcho(t, a, "a")

	s.reload("", site(999))
	wantEcho(t, a, "a after reload")
	wantEcho(t, b, "b after reload")
	resp := s.wantTryAgainLater("/", nil)
	wantHeader(t, resp, "X-RateLimit-Limit", "999")

	a.CloseNow()
	c := s.dialUntilAdmitted("/")
	wantEcho(t, c, "c")
	b.CloseNow()
	c.CloseNow()
}

// A refused client that never answers the close frame holds its connection
// for about a second (the refusal's grace), not for the 5 s write plus 5 s
// wait of the library's close handshake: a flood of refusals cannot pile up
// goroutines and sockets. The close frame still carries 1013.
func TestWebSocketRefusalBounded(t *testing.T) {
	backend := startEchoBackend(t)
	s := startCaddy(t, "", wsSite(backend, `
		zone ws_bounded
		window 60
		max 2
		ws_max_connections_per_ip 1`, ""))

	a, _ := s.mustDialWS("/") // 1
	wantEcho(t, a, "a")
	defer a.CloseNow()
	t.Run("over the cap", func(t *testing.T) { s.wantRefusalBounded(t) })  // 2
	t.Run("over the rate", func(t *testing.T) { s.wantRefusalBounded(t) }) // 3
	wantEcho(t, a, "a still up")
}

// wantRefusalBounded opens a WebSocket by hand as a peer that reads the 101
// and the close frame but never answers it, and fails t unless the frame is
// a 1013 close and the server drops the TCP connection within 3 s.
func (s *server) wantRefusalBounded(t *testing.T) {
	t.Helper()
	conn, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", s.Port))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"+
		"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n", s.Port)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("reading the handshake response: %v", err)
	}
	upgraded := time.Now()
	if resp.StatusCode != http.StatusSwitchingProtocols {
		t.Fatalf("status = %d, want 101", resp.StatusCode)
	}

	// An unmasked close frame (FIN, opcode 8) with a short payload: the
	// status code, big-endian, then the reason.
	var head [2]byte
	if _, err := io.ReadFull(br, head[:]); err != nil {
		t.Fatalf("reading the close frame: %v", err)
	}
	if head[0] != 0x88 || head[1] > 125 {
		t.Fatalf("frame header = %#x %#x, want an unmasked close frame (0x88, length <= 125)", head[0], head[1])
	}
	payload := make([]byte, head[1])
	if _, err := io.ReadFull(br, payload); err != nil {
		t.Fatalf("reading the close payload: %v", err)
	}
	if want := append([]byte{0x03, 0xF5}, "Try Again Later"...); !bytes.Equal(payload, want) {
		t.Fatalf("close payload = %q, want %q (1013 Try Again Later)", payload, want)
	}

	// Never answer; wait for the server to hang up.
	n, err := br.Read(make([]byte, 1))
	elapsed := time.Since(upgraded)
	if n > 0 {
		t.Fatalf("server sent more after the close frame")
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("connection still open %s after the close frame, want it dropped within 3s", elapsed)
	}
	t.Logf("server dropped the silent peer %s after the 101 (%v)", elapsed.Round(time.Millisecond), err)
	if elapsed > 3*time.Second {
		t.Fatalf("server dropped the silent peer after %s, want within 3s", elapsed)
	}
	if elapsed < 500*time.Millisecond {
		t.Fatalf("server dropped the peer after %s, before it had a chance to answer the close", elapsed)
	}
}

// A slot comes back when the backend closes the socket and when
// reverse_proxy's stream_timeout ends it.
func TestWebSocketSlotFreedByBackendAndTimeout(t *testing.T) {
	backend := startEchoBackend(t)
	s := startCaddy(t, "", wsSite(backend, `
		zone ws_ends
		window 60
		max 1000
		ws_max_connections_per_ip 1`, "stream_timeout 1s"))

	a, _ := s.mustDialWS("/")
	wantEcho(t, a, "a")
	s.wantTryAgainLater("/", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.Write(ctx, websocket.MessageText, []byte("bye")); err != nil {
		t.Fatalf("writing bye: %v", err)
	}
	if code, reason := closeStatus(t, a); code != websocket.StatusNormalClosure {
		t.Fatalf("after bye: close %d %q, want the backend's 1000", code, reason)
	}

	b := s.dialUntilAdmitted("/")
	opened := time.Now()
	s.wantTryAgainLater("/", nil)
	closeStatus(t, b) // ended by stream_timeout
	if d := time.Since(opened); d < 500*time.Millisecond {
		t.Fatalf("socket ended after %s, before stream_timeout", d)
	}
	c := s.dialUntilAdmitted("/")
	wantEcho(t, c, "c")
	c.CloseNow()
}

// No slot leaks: after 1,000 connect/disconnect cycles, a third of them
// dropped abruptly (half with a TCP reset, half with a bare FIN), and a
// config reload that closes the streams open at the time, the cap admits
// exactly n sockets again.
func TestWebSocketNoLeak(t *testing.T) {
	const n = 3
	backend := startEchoBackend(t)
	site := func(max int) string {
		return wsSite(backend, fmt.Sprintf(`
		zone ws_leak
		window 60
		max %d
		ws_max_connections_per_ip %d`, max, n), "")
	}
	s := startCaddy(t, "", site(100000))

	start := time.Now()
	echoed := 0
	for i := range 1000 {
		if i == 500 {
			// Two sockets open across a reload: the old reverse_proxy
			// closes its streams when its config is unloaded.
			h1, h2 := s.dialUntilAdmitted("/"), s.dialUntilAdmitted("/")
			s.reload("", site(99999))
			for _, h := range []*websocket.Conn{h1, h2} {
				if code, reason := closeStatus(t, h); code == websocket.StatusTryAgainLater {
					t.Fatalf("socket open across the reload: close %d %q, want the stream ended by the reload", code, reason)
				}
			}
		}
		var raw net.Conn
		opts := &websocket.DialOptions{HTTPClient: &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
				raw = c
				return c, err
			},
		}}}
		c, _, err := s.dialWS("/", opts)
		if err != nil {
			t.Fatalf("cycle %d: dialing: %v", i, err)
		}
		if !echoes(c) {
			c.CloseNow() // refused: closed already
			continue
		}
		echoed++
		switch {
		case i%3 != 0:
			if err := c.Close(websocket.StatusNormalClosure, ""); err != nil {
				t.Fatalf("cycle %d: closing: %v", i, err)
			}
		case i%2 == 0: // abrupt: TCP reset, no close frame
			raw.(*net.TCPConn).SetLinger(0)
			raw.Close()
			c.CloseNow()
		default: // abrupt: FIN, no close frame
			c.CloseNow()
		}
	}
	t.Logf("1000 cycles in %s, %d echoed", time.Since(start), echoed)
	// A socket refused only because a dropped one was still being torn
	// down is fine; a run in which most are refused is not a test.
	if echoed < 900 {
		t.Fatalf("only %d of 1000 cycles echoed", echoed)
	}

	// Exactly n again: n admitted, the next one closed with 1013.
	var held []*websocket.Conn
	for range n {
		held = append(held, s.dialUntilAdmitted("/"))
	}
	s.wantTryAgainLater("/", nil)
	for _, c := range held {
		wantEcho(t, c, "still here")
		c.CloseNow()
	}
	deadline := time.Now().Add(5 * time.Second)
	for backend.open.Load() != 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if open := backend.open.Load(); open != 0 {
		t.Errorf("backend has %d sockets open after every client left", open)
	}
}

// A WebSocket is a request in flight while it lives: with max_in_flight 1
// it holds its client's slot, so another request of the client is refused
// with Retry-After: 1 until the socket closes.
func TestWebSocketHoldsInFlightSlot(t *testing.T) {
	backend := startEchoBackend(t)
	s := startCaddy(t, "", wsSite(backend, `
		zone `+fresh("ws-in-flight")+`
		window 60
		max 10
		max_in_flight 1`, ""))
	c, _ := s.mustDialWS("/")
	wantEcho(t, c, "hello")
	if resp, _ := s.get("/"); resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("a request while the socket lives: %d, Retry-After %q; want 429 and 1", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	c.Close(websocket.StatusNormalClosure, "")
	if !eventually(func() bool { resp, _ := s.get("/"); return resp.StatusCode != http.StatusTooManyRequests }) {
		t.Fatal("the socket's slot was not given back when it closed")
	}
}
