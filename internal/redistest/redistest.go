// Package redistest starts throwaway Redis servers for tests: a real
// redis-server on a free loopback port (or a three-master Cluster), or, on a
// machine without redis-server and outside CI, an in-process miniredis.
package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Kinds of server Start may return.
const (
	KindReal      = "redis-server"
	KindMiniredis = "miniredis"
)

// Server is one Redis server started for a test. It is stopped when the test
// ends.
type Server struct {
	// Addr is the server's host:port.
	Addr string
	// Kind is KindReal or KindMiniredis.
	Kind string

	t    testing.TB
	port int
	bin  string
	dir  string
	args []string
	cmd  *exec.Cmd
	mini *miniredis.Miniredis
}

// InCI reports whether the tests run in CI (CI=true), where the Redis tests
// must run against a real redis-server.
func InCI() bool { return os.Getenv("CI") == "true" }

// Start starts a Redis server on a free loopback port and stops it when the
// test ends. It uses redis-server from PATH; without one it fails the test
// in CI and otherwise falls back to an in-process miniredis. It logs which
// server it used.
func Start(t testing.TB) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if InCI() {
			t.Fatalf("CI=true but no redis-server in PATH: the Redis tests need a real server (%v)", err)
		}
		m := miniredis.NewMiniRedis()
		if err := m.Start(); err != nil {
			t.Fatalf("starting miniredis: %v", err)
		}
		stop := runClock(m)
		t.Cleanup(func() { stop(); m.Close() })
		s := &Server{Addr: m.Addr(), Kind: KindMiniredis, t: t, mini: m}
		announce(t, s)
		return s
	}
	s := launch(t, bin, freePort, nil)
	announce(t, s)
	return s
}

// StartReal is Start for a test that needs a real redis-server (for why:
// something miniredis lacks): on a machine without one it skips.
func StartReal(t testing.TB, why string) *Server {
	t.Helper()
	s := Start(t)
	if s.Kind != KindReal {
		t.Skipf("%s: %s", s.Kind, why)
	}
	return s
}

// launch starts redis-server on a port from port with the extra arguments
// args gives for the server (nil: none), retrying on a new port when the
// first is taken before redis binds it, and stops it when the test ends.
func launch(t testing.TB, bin string, port func(testing.TB) int, args func(*Server) []string) *Server {
	t.Helper()
	var lastErr error
	for range 5 {
		s := &Server{Kind: KindReal, t: t, bin: bin, dir: t.TempDir(), port: port(t)}
		s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
		if args != nil {
			s.args = args(s)
		}
		if lastErr = s.start(); lastErr == nil {
			t.Cleanup(s.Stop)
			return s
		}
	}
	t.Fatalf("starting redis-server: %v", lastErr)
	return nil
}

// announce logs which server a test uses, on stderr too so that a plain
// go test run shows it.
func announce(t testing.TB, s *Server) {
	msg := fmt.Sprintf("redistest: %s using %s at %s", t.Name(), s.Kind, s.Addr)
	t.Log(msg)
	fmt.Fprintln(os.Stderr, msg)
}

// start runs redis-server with the server's port and waits until it answers.
func (s *Server) start(extra ...string) error {
	args := append([]string{
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir,
		"--protected-mode", "no", "--loglevel", "warning",
	}, s.args...)
	args = append(args, extra...)
	cmd := exec.Command(s.bin, args...)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	dieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		return err
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	c := redis.NewClient(&redis.Options{Addr: s.Addr, MaxRetries: -1, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case err := <-exited:
			return fmt.Errorf("redis-server on port %d exited: %v", s.port, err)
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			s.cmd = cmd
			// Keep the exit status for Stop.
			go func() { <-exited }()
			return nil
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			return fmt.Errorf("redis-server on port %d did not answer: %v", s.port, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server at once, as a crash would. It is safe to call twice.
func (s *Server) Stop() {
	if s.mini != nil {
		s.mini.Close()
		return
	}
	if s.cmd == nil {
		return
	}
	_ = signal(s.cmd.Process, false) // a paused server dies too
	_ = s.cmd.Process.Kill()
	// Wait until the port no longer answers, so the caller sees a dead
	// server.
	for i := 0; i < 100; i++ {
		conn, err := net.DialTimeout("tcp", s.Addr, 50*time.Millisecond)
		if err != nil {
			break
		}
		conn.Close()
		time.Sleep(10 * time.Millisecond)
	}
	s.cmd = nil
}

// Pause freezes the server (SIGSTOP): connections stay open but nothing
// answers, as with a hung or overloaded Redis. It reports false on
// miniredis, which cannot be frozen.
func (s *Server) Pause() bool {
	if s.cmd == nil {
		return false
	}
	return signal(s.cmd.Process, true) == nil
}

// Resume undoes Pause.
func (s *Server) Resume() {
	if s.cmd != nil {
		_ = signal(s.cmd.Process, false)
	}
}

// Restart starts a stopped server again on the same address, empty.
func (s *Server) Restart() {
	s.t.Helper()
	if s.mini != nil {
		if err := s.mini.Restart(); err != nil {
			s.t.Fatalf("restarting miniredis: %v", err)
		}
		return
	}
	var err error
	for range 50 { // the old process may still hold the port a moment
		if err = s.start(); err == nil {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	s.t.Fatalf("restarting redis-server: %v", err)
}

// Sleep waits d: the server's keys age by d, miniredis's too (runClock).
func (s *Server) Sleep(d time.Duration) {
	time.Sleep(d)
}

// runClock makes m's keys expire with the time that passes, as a real
// server's do (miniredis expires keys only when told to move its clock),
// until the returned func is called.
func runClock(m *miniredis.Miniredis) func() {
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		last := time.Now()
		for {
			select {
			case <-done:
				return
			case now := <-tick.C:
				m.FastForward(now.Sub(last))
				last = now
			}
		}
	}()
	return sync.OnceFunc(func() { close(done) })
}

// StartCluster starts a Redis Cluster of three masters (no replicas) on
// free loopback ports and returns their addresses; it is stopped when the
// test ends. Without redis-server it fails the test in CI and skips it
// otherwise: miniredis is no Cluster.
func StartCluster(t testing.TB) []string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if InCI() {
			t.Fatalf("CI=true but no redis-server in PATH: the Cluster test needs real servers (%v)", err)
		}
		t.Skipf("no redis-server in PATH, so no Cluster: %v", err)
	}
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		if InCI() {
			t.Fatalf("CI=true but no redis-cli in PATH to create the Cluster: %v", err)
		}
		t.Skipf("no redis-cli in PATH to create a Cluster: %v", err)
	}
	var addrs []string
	for range 3 {
		s := launch(t, bin, freeClusterPort, func(s *Server) []string {
			return []string{"--cluster-enabled", "yes", "--cluster-config-file", s.dir + "/nodes.conf", "--cluster-node-timeout", "2000"}
		})
		addrs = append(addrs, s.Addr)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command(cli, args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	deadline := time.Now().Add(20 * time.Second)
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		for {
			info, err := c.ClusterInfo(context.Background()).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				c.Close()
				t.Fatalf("cluster node %s not ready: %v %s", a, err, info)
			}
			time.Sleep(50 * time.Millisecond)
		}
		c.Close()
	}
	msg := fmt.Sprintf("redistest: %s using a redis-server Cluster at %s", t.Name(), strings.Join(addrs, " "))
	t.Log(msg)
	fmt.Fprintln(os.Stderr, msg)
	return addrs
}

// freePort returns a loopback TCP port that was free a moment ago.
func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// freeClusterPort returns a free port whose cluster bus port (port+10000)
// is free too.
func freeClusterPort(t testing.TB) int {
	for range 100 {
		p := freePort(t)
		if p+10000 > 65535 {
			continue
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p+10000)))
		if err != nil {
			continue
		}
		l.Close()
		return p
	}
	t.Fatal("no free port pair for a cluster node")
	return 0
}

// Listener is a loopback TCP listener that counts the connections made to
// it and closes each at once: an address for a test that must show nothing
// connects (to a Redis that is not there) until something should.
type Listener struct {
	Addr     string
	accepted atomic.Int64
}

// Listen starts a Listener; it stops when the test ends.
func Listen(t testing.TB) *Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &Listener{Addr: ln.Addr().String()}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			l.accepted.Add(1)
			c.Close()
		}
	}()
	return l
}

// Accepted returns how many connections the listener has taken.
func (l *Listener) Accepted() int64 { return l.accepted.Load() }
