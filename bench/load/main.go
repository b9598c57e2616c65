// Command load compares Caddy with the rate_limit handler against bare
// Caddy under wrk, on loopback: each scenario runs on both builds in
// alternation (bare, module, bare, module, …) for several rounds, and the
// medians of req/s, latency, Caddy's CPU time per request and peak RSS are
// printed with their ratios, and the medians of the rounds' paired ratios
// (each B against the A just before it, which the machine's drift between
// rounds moves less).
//
//	go run ./bench/load [-rounds 3] [-duration 8s] [-connections 32] [-only 'name prefix;whole name$;…']
//
// The floor scenarios give B a handler that does nothing (rate_limit with
// enabled false) or, on a third build, nothing but the quota headers
// (bench/headerfloor) or the Redis round trip (bench/redisfloor): what
// Caddy, net/http, the client and go-redis cost before any limiter decides
// anything. A scenario that names its A runs it on the module's build
// too, in another configuration: 100,000 keys against one key, sync mode
// against the memory store.
//
// It needs wrk and, for the Redis scenarios, redis-server on the PATH. It
// builds the Caddys into a temporary directory, starts each on a free
// loopback port (checking that the answers come from the Caddy it started:
// Caddy binds with SO_REUSEPORT, so a port another server holds would be
// shared silently), and starts its own redis-server.
package main

import (
	"bufio"
	"bytes"
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// scenario is one load shape: the rate_limit block of the module's config
// ("" for none) and what wrk sends.
type scenario struct {
	name    string
	limit   string // the rate_limit block, with $REDIS for the redis-server's address
	clients int    // distinct X-Client values (bench/clients.lua); 0: one client, no header
	xff     bool   // send the clients as IPv4 addresses in X-Forwarded-For, trusted from loopback (both builds)
	redis   bool
	floor   bool // run B on the floor build (bench/floorcaddy), for quota_floor and redis_floor
	// base is the rate_limit block A runs on the module's build, in place
	// of bare Caddy: B against another configuration of the module.
	base string
}

// The blocks of the 100,000-client scenarios: the memory store, the same
// with one key for every client, and sync mode with the store's options
// the defaults but sync itself.
const (
	oneKey100k = "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\tmax_tracked 200000\n\t\tkey {http.request.method}\n\t}"
	memory100k = "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\tmax_tracked 200000\n\t\tkey {http.request.header.X-Client}\n\t}"
	sync100k   = "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\tmax_tracked 200000\n\t\tkey {http.request.header.X-Client}\n\t\tstore redis {\n\t\t\taddress $REDIS\n\t\t\tsync 100ms\n\t\t}\n\t}"
)

var scenarios = []scenario{
	// The floor: Caddy's own cost of one more handler in the route, which
	// passes every request on. No rate limiter in Caddy can cost less.
	{name: "floor: enabled false, one client", limit: "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\tenabled false\n\t}"},
	// The floor of any limiter that sends the default quota headers: the
	// same three headers, values of the same lengths, no decision
	// (bench/headerfloor).
	{name: "floor: quota headers, one client", floor: true, limit: "quota_floor"},
	{name: "admitted, one client", limit: "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t}"},
	{name: "admitted, one client, headers none", limit: "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\theaders none\n\t}"},
	{name: "refused, one client flooding", limit: "rate_limit {\n\t\tzone bench\n\t\tmax 1\n\t}"},
	// The floor of a refusal: the same 429 and headers, no decision.
	{name: "floor: quota headers, refused", floor: true, limit: "quota_floor refuse"},
	{name: "admitted, 100000 clients", clients: 100_000, limit: memory100k},
	// What many keys cost over one, the traffic the same: A counts every
	// request under one key (the method's), B under each client's.
	{name: "100000 keys (B) against one key (A), 100000 clients", clients: 100_000, base: oneKey100k, limit: memory100k},
	// The floor of any limiter that counts each client: a sharded Go map
	// from the client to a counter, nothing else (bench/keysfloor).
	{name: "floor: count per key, 100000 clients", clients: 100_000, floor: true, limit: "keys_floor"},
	{name: "admitted, 1000000 IPv4 clients", clients: 1_000_000, xff: true,
		limit: "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\tmax_tracked 1100000\n\t}"},
	{name: "floor: count per key, 1000000 IPv4 clients", clients: 1_000_000, xff: true, floor: true, limit: "keys_floor"},
	{name: "admitted, 100000 clients, Redis, pipeline on", clients: 100_000, redis: true,
		limit: "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\tkey {http.request.header.X-Client}\n\t\tstore redis {\n\t\t\taddress $REDIS\n\t\t\ttimeout 1s\n\t\t\tpipeline on\n\t\t}\n\t}"},
	{name: "admitted, 100000 clients, Redis, pipeline off", clients: 100_000, redis: true,
		limit: "rate_limit {\n\t\tzone bench\n\t\tmax 1000000000\n\t\tkey {http.request.header.X-Client}\n\t\tstore redis {\n\t\t\taddress $REDIS\n\t\t\ttimeout 1s\n\t\t\tpipeline off\n\t\t}\n\t}"},
	// Sync mode: decisions in memory, the keys touched synced every 100ms;
	// against bare Caddy, and against the memory store (A) in alternation.
	{name: "admitted, 100000 clients, Redis, sync 100ms", clients: 100_000, redis: true, limit: sync100k},
	{name: "sync 100ms (B) against the memory store (A), 100000 clients", clients: 100_000, redis: true, base: memory100k, limit: sync100k},
	// The floor of any limiter that asks Redis once per request: the same
	// round trip (EVALSHA, one key, the same client settings) running
	// return 1, and no limiter.
	{name: "floor: Redis round trip, return 1, pipeline on", clients: 100_000, redis: true, floor: true, limit: "redis_floor $REDIS pipeline"},
	{name: "floor: Redis round trip, return 1, pipeline off", clients: 100_000, redis: true, floor: true, limit: "redis_floor $REDIS"},
}

// result is one run's figures.
type result struct {
	rps, p50, p99 float64 // req/s; latencies in ms
	cpuPerReq     float64 // Caddy's CPU time per request, µs
	rssMB         float64 // Caddy's peak RSS (VmHWM), MB
	non2xx        int
	redis         string // what Redis reports of the script calls of the measured run
}

func main() {
	rounds := flag.Int("rounds", 3, "alternating rounds per scenario")
	duration := flag.Duration("duration", 8*time.Second, "wrk run per round")
	conns := flag.Int("connections", 32, "wrk connections (one thread)")
	only := flag.String("only", "", "semicolon-separated scenario name prefixes to run (default all)")
	flag.Parse()
	log.SetFlags(0)

	for _, tool := range []string{"wrk", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			log.Fatalf("%s is not on the PATH (Debian: apt-get install %s)", tool, tool)
		}
	}
	root, err := moduleRoot()
	if err != nil {
		log.Fatal(err)
	}
	dir, err := os.MkdirTemp("", "rate-limit-load-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	bare, with, floor := filepath.Join(dir, "caddy-bare"), filepath.Join(dir, "caddy-rate-limit"), filepath.Join(dir, "caddy-floor")
	for bin, pkg := range map[string]string{bare: "./bench/barecaddy", with: "./cmd/caddy", floor: "./bench/floorcaddy"} {
		log.Printf("building %s", pkg)
		cmd := exec.Command("go", "build", "-o", bin, pkg)
		cmd.Dir, cmd.Stdout, cmd.Stderr = root, os.Stderr, os.Stderr
		if err := cmd.Run(); err != nil {
			log.Fatalf("building %s: %v", pkg, err)
		}
	}
	lua := filepath.Join(root, "bench", "clients.lua")

	fmt.Printf("wrk -t1 -c%d -d%s on loopback, %d rounds alternating bare Caddy (A, unless a scenario names its A) and Caddy with rate_limit (B); medians\n\n", *conns, *duration, *rounds)
	fmt.Println("| scenario | A req/s | B req/s | B/A req/s | A CPU µs/req | B CPU µs/req | A/B CPU | B/A req/s, paired | A/B CPU, paired | A p50/p99 ms | B p50/p99 ms | A peak RSS | B peak RSS | B non-2xx | load average, start / end |")
	fmt.Println("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
	for _, sc := range scenarios {
		if !selected(sc.name, *only) {
			continue
		}
		load0 := loadAverage()
		var redisAddr string
		var stopRedis func()
		if sc.redis {
			redisAddr, stopRedis = startRedis(dir)
		}
		var a, b []result
		for round := range *rounds {
			for _, side := range []string{"A", "B"} {
				if sc.redis {
					flushRedis(redisAddr)
				}
				bin, block := bare, ""
				if sc.base != "" {
					bin, block = with, sc.base
				}
				if side == "B" {
					bin, block = with, sc.limit
					if sc.floor {
						bin = floor
					}
				}
				block = strings.ReplaceAll(block, "$REDIS", redisAddr)
				r := run(dir, bin, block, sc, lua, *conns, *duration, redisAddr)
				if r.redis != "" {
					log.Printf("%s, round %d, %s: redis-server %s", sc.name, round+1, side, r.redis)
				}
				log.Printf("%s, round %d, %s: %.0f req/s, %.1f µs CPU/req, p99 %.2f ms, peak RSS %.1f MB, non-2xx %d",
					sc.name, round+1, side, r.rps, r.cpuPerReq, r.p99, r.rssMB, r.non2xx)
				if side == "A" {
					a = append(a, r)
				} else {
					b = append(b, r)
				}
			}
		}
		if stopRedis != nil {
			stopRedis()
		}
		ma, mb := medians(a), medians(b)
		// The paired ratios compare each round's B with the A run just
		// before it: the machine's drift between rounds falls on both.
		var rps, cpu []float64
		for i := range a {
			rps = append(rps, b[i].rps/a[i].rps)
			cpu = append(cpu, a[i].cpuPerReq/b[i].cpuPerReq)
		}
		fmt.Printf("| %s | %.0f | %.0f | %.2f | %.1f | %.1f | %.2f | %.2f | %.2f | %.2f / %.2f | %.2f / %.2f | %.1f MB | %.1f MB | %d | %s / %s |\n",
			sc.name, ma.rps, mb.rps, mb.rps/ma.rps, ma.cpuPerReq, mb.cpuPerReq, ma.cpuPerReq/mb.cpuPerReq, median(rps), median(cpu),
			ma.p50, ma.p99, mb.p50, mb.p99, ma.rssMB, mb.rssMB, mb.non2xx, load0, loadAverage())
		if sc.clients > 0 {
			over := "bare"
			if sc.base != "" {
				over = "A"
			}
			fmt.Printf("|  ↳ peak RSS over %s per client key | | | | | | | | | | | %.0f B/key | | | |\n", over, (mb.rssMB-ma.rssMB)*1e6/float64(sc.clients))
		}
	}
}

// loadAverage returns the host's one-minute load average (/proc/loadavg),
// or "?" where there is none.
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); err == nil && len(f) > 0 {
		return f[0]
	}
	return "?"
}

// selected reports whether the scenario is among those -only names: a
// prefix of its name, or its whole name followed by $.
func selected(name, only string) bool {
	if only == "" {
		return true
	}
	for p := range strings.SplitSeq(only, ";") {
		p = strings.TrimSpace(p)
		if whole, ok := strings.CutSuffix(p, "$"); ok && name == whole || !ok && strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// run starts bin with a site holding block, loads it with wrk and returns
// the figures.
func run(dir, bin, block string, sc scenario, lua string, conns int, d time.Duration, redisAddr string) result {
	ports := freePorts(2) // the site's, and the admin endpoint's when it has one
	port := ports[0]
	mark := strconv.FormatInt(time.Now().UnixNano(), 36)
	servers := ""
	if sc.xff {
		servers = "servers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t\tclient_ip_headers X-Forwarded-For\n\t}"
	}
	// A Redis run's admin endpoint serves the sync metrics (keys synced).
	admin, adminPort := "admin off", 0
	if sc.redis {
		adminPort = ports[1]
		admin = fmt.Sprintf("admin 127.0.0.1:%d", adminPort)
	}
	cfg := fmt.Sprintf(`{
	%s
	auto_https off
	persist_config off
	grace_period 1s
	%s
}

http://127.0.0.1:%d {
	header X-Bench-Run %s
	%s
	respond "ok"
}
`, admin, servers, port, mark, block)
	path := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		log.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--config", path, "--adapter", "caddyfile")
	var logs bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logs, &logs
	if err := cmd.Start(); err != nil {
		log.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	base := fmt.Sprintf("http://127.0.0.1:%d/", port)
	if err := waitFor(base, mark); err != nil {
		log.Fatalf("caddy %s: %v\n%s", filepath.Base(bin), err, logs.String())
	}
	args := []string{"-t1", fmt.Sprintf("-c%d", conns), "--latency"}
	if sc.clients > 0 {
		args = append(args, "-s", lua)
	}
	env := append(os.Environ(), fmt.Sprintf("CLIENTS=%d", max(sc.clients, 1)))
	if sc.xff {
		env = append(env, "HEADER=X-Forwarded-For")
	}
	// Warm up: a second, and with many clients until every client has
	// been sent (tracked) before the measured run, at the rate seen so far.
	// Each wrk run goes on from the clients the runs before it sent.
	from := func(n int) []string { return append(env, fmt.Sprintf("START=%d", n)) }
	warmed, warmedFor := 0, time.Second
	warmed += parseRequests(wrk(append(args, "-d1s", base), from(0)))
	for warmed < sc.clients && warmed > 0 && warmedFor < 5*time.Minute {
		rest := time.Duration(float64(sc.clients-warmed)/float64(warmed)*float64(warmedFor)*1.1) + time.Second
		rest = rest.Round(time.Second)
		warmed += parseRequests(wrk(append(args, fmt.Sprintf("-d%s", rest), base), from(warmed)))
		warmedFor += rest
	}
	var redisCPU0, keys0 float64
	if redisAddr != "" {
		resetRedisStats(redisAddr)
		redisCPU0, keys0 = redisCPU(redisAddr), syncedKeys(adminPort)
	}
	cpu0 := cpuTicks(cmd.Process.Pid)
	out := wrk(append(args, fmt.Sprintf("-d%s", d), base), from(warmed))
	cpu1 := cpuTicks(cmd.Process.Pid)
	r := parseWrk(out)
	if redisAddr != "" {
		r.redis = redisScriptStats(redisAddr, d)
		if keys := syncedKeys(adminPort) - keys0; keys > 0 {
			cpu := redisCPU(redisAddr) - redisCPU0
			r.redis += fmt.Sprintf("; sync: %.0f keys synced, Redis CPU %.2fs, %.1f µs per key", keys, cpu, cpu*1e6/keys)
		}
	}
	reqs := parseRequests(out)
	if sc.clients > 0 && warmed+reqs < sc.clients {
		log.Printf("%s: only %d requests, fewer than the %d clients: not every client was tracked", sc.name, warmed+reqs, sc.clients)
	}
	if reqs > 0 {
		r.cpuPerReq = float64(cpu1-cpu0) / clockTicks * 1e6 / float64(reqs)
	}
	r.rssMB = peakRSS(cmd.Process.Pid)
	return r
}

// wrk runs wrk and returns its output.
func wrk(args []string, env []string) string {
	cmd := exec.Command("wrk", args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		log.Fatalf("wrk %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// waitFor waits until url answers with the run's mark, then checks that 20
// answers on new connections all carry it: the Caddy we started, and no
// other server sharing the port (the kernel spreads new connections over
// every listener of an SO_REUSEPORT port).
func waitFor(url, mark string) error {
	c := &http.Client{Timeout: time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	deadline := time.Now().Add(15 * time.Second)
	for ok := 0; ok < 20; {
		if time.Now().After(deadline) {
			return fmt.Errorf("no answer from %s", url)
		}
		resp, err := c.Get(url)
		if err != nil {
			ok = 0
			time.Sleep(50 * time.Millisecond)
			continue
		}
		resp.Body.Close()
		if got := resp.Header.Get("X-Bench-Run"); got != mark {
			if ok > 0 || got != "" {
				return fmt.Errorf("port %s also answered by another server (mark %q)", url, got)
			}
			time.Sleep(50 * time.Millisecond)
			continue
		}
		ok++
	}
	return nil
}

var (
	rpsRe      = regexp.MustCompile(`Requests/sec:\s+([\d.]+)`)
	latRe      = regexp.MustCompile(`(?m)^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$`)
	requestsRe = regexp.MustCompile(`(\d+) requests in`)
	non2xxRe   = regexp.MustCompile(`Non-2xx or 3xx responses: (\d+)`)
)

// parseWrk reads req/s, p50, p99 and the non-2xx count from wrk's output.
func parseWrk(out string) result {
	var r result
	if m := rpsRe.FindStringSubmatch(out); m != nil {
		r.rps, _ = strconv.ParseFloat(m[1], 64)
	}
	for _, m := range latRe.FindAllStringSubmatch(out, -1) {
		v, _ := strconv.ParseFloat(m[2], 64)
		switch m[3] {
		case "us":
			v /= 1000
		case "s":
			v *= 1000
		}
		if m[1] == "50" {
			r.p50 = v
		} else {
			r.p99 = v
		}
	}
	if m := non2xxRe.FindStringSubmatch(out); m != nil {
		r.non2xx, _ = strconv.Atoi(m[1])
	}
	return r
}

// parseRequests reads how many requests wrk completed.
func parseRequests(out string) int {
	m := requestsRe.FindStringSubmatch(out)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// median returns the median of v (which it sorts), 0 for none.
func median(v []float64) float64 {
	sort.Float64s(v)
	if len(v) == 0 {
		return 0
	}
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// clockTicks is the kernel's USER_HZ, as /proc/<pid>/stat counts.
const clockTicks = 100

// cpuTicks returns the process's user and system time in clock ticks.
func cpuTicks(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	u, _ := strconv.ParseInt(fields[11], 10, 64) // utime is field 14 of the line
	k, _ := strconv.ParseInt(fields[12], 10, 64) // stime, field 15
	return u + k
}

// peakRSS returns the process's peak resident set (VmHWM) in MB.
func peakRSS(pid int) float64 {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmHWM:"); ok {
			kib, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64) // "kB" is KiB
			return kib * 1024 / 1e6
		}
	}
	return 0
}

// medians returns the median of each figure.
func medians(rs []result) result {
	med := func(get func(result) float64) float64 {
		v := make([]float64, len(rs))
		for i, r := range rs {
			v[i] = get(r)
		}
		return median(v)
	}
	non2xx := make([]int, len(rs))
	for i, r := range rs {
		non2xx[i] = r.non2xx
	}
	slices.Sort(non2xx)
	return result{
		rps:       med(func(r result) float64 { return r.rps }),
		p50:       med(func(r result) float64 { return r.p50 }),
		p99:       med(func(r result) float64 { return r.p99 }),
		cpuPerReq: med(func(r result) float64 { return r.cpuPerReq }),
		rssMB:     med(func(r result) float64 { return r.rssMB }),
		non2xx:    non2xx[len(non2xx)/2],
	}
}

// freePort returns a loopback port that was free a moment ago (waitFor
// checks that the Caddy started on it is the one answering).
func freePort() int { return freePorts(1)[0] }

// freePorts returns n distinct free loopback ports: each is held until
// all are found, so that the kernel cannot hand out one of them twice.
func freePorts(n int) []int {
	ports := make([]int, n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			log.Fatal(err)
		}
		defer l.Close()
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports
}

// startRedis starts a redis-server without persistence on a free port.
func startRedis(dir string) (string, func()) {
	port := freePort()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, "redis-server", "--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", dir)
	if err := cmd.Start(); err != nil {
		log.Fatalf("redis-server: %v (Debian: apt-get install redis-server)", err)
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	for i := 0; ; i++ {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			break
		}
		if i > 100 {
			log.Fatalf("redis-server on %s did not start", addr)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return addr, func() { cancel(); _ = cmd.Wait() }
}

// flushRedis empties the Redis between runs, so that each starts from no
// keys.
func flushRedis(addr string) {
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.FlushAll(ctx).Err(); err != nil {
		log.Fatalf("FLUSHALL on %s: %v", addr, err)
	}
}

// redisInfo returns a section of redis-server's INFO.
func redisInfo(addr, section string) (string, error) {
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Info(ctx, section).Result()
}

// redisCPU returns the CPU time redis-server has used, in seconds (INFO cpu).
func redisCPU(addr string) float64 {
	info, err := redisInfo(addr, "cpu")
	if err != nil {
		log.Fatalf("redis INFO cpu: %v", err)
	}
	var sum float64
	for line := range strings.SplitSeq(info, "\n") {
		k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
		if k == "used_cpu_sys" || k == "used_cpu_user" {
			f, _ := strconv.ParseFloat(v, 64)
			sum += f
		}
	}
	return sum
}

// syncedKeys returns caddy_rate_limit_sync_keys_total, summed over zones,
// from the metrics of the Caddy whose admin endpoint is on port (0 when it
// has none: the bare build, or exact mode).
func syncedKeys(port int) float64 {
	resp, err := http.Get(fmt.Sprintf("http://127.0.0.1:%d/metrics", port))
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	var sum float64
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "caddy_rate_limit_sync_keys_total") {
			if i := strings.LastIndexByte(line, ' '); i > 0 {
				f, _ := strconv.ParseFloat(line[i+1:], 64)
				sum += f
			}
		}
	}
	return sum
}

// resetRedisStats zeroes Redis's command statistics (CONFIG RESETSTAT).
func resetRedisStats(addr string) {
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.ConfigResetStat(ctx).Err(); err != nil {
		log.Fatalf("redis CONFIG RESETSTAT: %v", err)
	}
}

// redisScriptStats returns what Redis reports of the script calls since
// resetRedisStats (INFO commandstats), with the calls per second over a run
// of d and the share of a core they took.
func redisScriptStats(addr string, d time.Duration) string {
	info, err := redisInfo(addr, "commandstats")
	if err != nil {
		return err.Error()
	}
	var out []string
	for line := range strings.SplitSeq(info, "\n") {
		if strings.HasPrefix(line, "cmdstat_evalsha:") || strings.HasPrefix(line, "cmdstat_eval:") {
			line = strings.TrimSpace(line)
			var calls, usec int64
			for f := range strings.SplitSeq(line[strings.IndexByte(line, ':')+1:], ",") {
				k, v, _ := strings.Cut(f, "=")
				switch k {
				case "calls":
					calls, _ = strconv.ParseInt(v, 10, 64)
				case "usec":
					usec, _ = strconv.ParseInt(v, 10, 64)
				}
			}
			out = append(out, fmt.Sprintf("%s (%.0f calls/s, %.1f%% of a core)", line,
				float64(calls)/d.Seconds(), 100*float64(usec)/float64(d.Microseconds())))
		}
	}
	if len(out) == 0 {
		return "no script calls"
	}
	return strings.Join(out, " ")
}

// moduleRoot returns the root of this module (where go.mod is).
func moduleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", err
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", fmt.Errorf("run from inside the module (go env GOMOD is empty)")
	}
	return filepath.Dir(mod), nil
}
