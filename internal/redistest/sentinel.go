package redistest

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelMaster is the name the Sentinel of StartSentinel knows its master
// by.
const SentinelMaster = "rltest"

// Sentinel is a master, its replica and one Sentinel watching them, started
// by StartSentinel. The Sentinel declares the master down after a second
// without answers and fails over to the replica.
type Sentinel struct {
	Master, Replica *Server
	// Addr is the Sentinel's host:port.
	Addr string
}

// StartSentinel starts a master, a replica of it and a Sentinel on free
// loopback ports; they are stopped when the test ends. Without redis-server
// it fails the test in CI and skips it otherwise: miniredis has no Sentinel.
func StartSentinel(t testing.TB) *Sentinel {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if InCI() {
			t.Fatalf("CI=true but no redis-server in PATH: the Sentinel test needs real servers (%v)", err)
		}
		t.Skipf("no redis-server in PATH, so no Sentinel: %v", err)
	}
	sn := &Sentinel{Master: launch(t, bin, freePort, nil)}
	host, port, _ := net.SplitHostPort(sn.Master.Addr)
	sn.Replica = launch(t, bin, freePort, func(*Server) []string { return []string{"--replicaof", host, port} })

	// The Sentinel rewrites its config file, so it gets one of its own.
	dir := t.TempDir()
	sport := freePort(t)
	conf := filepath.Join(dir, "sentinel.conf")
	body := fmt.Sprintf("port %d\nbind 127.0.0.1\nprotected-mode no\ndir %s\n"+
		"sentinel monitor %s %s %s 1\n"+
		"sentinel down-after-milliseconds %s 1000\n"+
		"sentinel failover-timeout %s 5000\n"+
		"sentinel parallel-syncs %s 1\n",
		sport, dir, SentinelMaster, host, port, SentinelMaster, SentinelMaster, SentinelMaster)
	if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, conf, "--sentinel", "--loglevel", "warning")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	dieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting redis sentinel: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	sn.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(sport))

	// Ready when the Sentinel knows the master and its replica.
	c := redis.NewSentinelClient(&redis.Options{Addr: sn.Addr, DialTimeout: 200 * time.Millisecond})
	defer c.Close()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		replicas, err := c.Replicas(ctx, SentinelMaster).Result()
		cancel()
		if err == nil && len(replicas) > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("sentinel at %s not ready: %v", sn.Addr, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	msg := fmt.Sprintf("redistest: %s using master %s, replica %s, sentinel %s", t.Name(), sn.Master.Addr, sn.Replica.Addr, sn.Addr)
	t.Log(msg)
	fmt.Fprintln(os.Stderr, msg)
	return sn
}
