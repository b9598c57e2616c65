package ratelimit

// The Redis store's Caddy side: the store object's options, their checks and
// placeholders, the clients zones share, and building a zone's store.

import (
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/caddyserver/caddy/v2"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/limiter"
)

// Defaults of the Redis store options left unset.
const (
	DefaultRedisKeyPrefix = "caddy_rate_limit:"
	DefaultRedisTimeout   = limiter.DefaultTimeout

	// MaxRedisTimeout is the longest timeout accepted, and the client's
	// read and write timeout.
	MaxRedisTimeout = 10 * time.Second
	// MinRedisTimeout is the shortest timeout accepted: below it no round
	// trip completes, and every decision would be made as on_error says.
	MinRedisTimeout = time.Millisecond
)

// maxPort is the highest TCP port.
const maxPort = 65535

// redisClients holds the Redis clients, one per distinct connection config.
// It is a package-level UsagePool because a client (its connection pool) is
// shared by every zone that connects to the same Redis and must outlive a
// config reload; the last zone to let go of it closes it.
var redisClients = caddy.NewUsagePool()

// StoreConfig selects the store that keeps a zone's counters and configures
// it. In JSON: {"type": "redis", "addresses": ["127.0.0.1:6379"], ...}.
type StoreConfig struct {
	// Type is "memory" (the in-process store, bounded by max_tracked) or
	// "redis" (counters in Redis, shared by every Caddy instance using it,
	// so several instances behind a load balancer enforce one limit).
	// Default: "memory".
	Type string `json:"type,omitempty"`

	// Addresses are the Redis servers as host:port (a port from 1 to
	// 65535). One address is a
	// single server; several are the seed nodes of a Redis Cluster (or, with
	// master_name, Sentinels). Placeholders such as {env.REDIS_ADDR} are
	// replaced when the config loads. Either addresses or url is required.
	Addresses []string `json:"addresses,omitempty"`

	// URL is a single server as a URL:
	// redis://[user[:password]@]host[:port][/db] (rediss:// for TLS). It
	// replaces addresses, username, password, db and tls.
	URL string `json:"url,omitempty"`

	// MasterName is the name of the master the Sentinels at addresses
	// watch; set it to use Redis Sentinel. Default: none.
	MasterName string `json:"master_name,omitempty"`

	// Username authenticates with Redis ACLs. Default: none.
	Username string `json:"username,omitempty"`

	// Password authenticates with Redis; write a placeholder such as
	// {env.REDIS_PASSWORD} to keep it out of the config. Default: none.
	Password string `json:"password,omitempty"`

	// DB is the database number (single server and Sentinel only; a
	// Cluster has only database 0). Default: 0.
	DB int `json:"db,omitempty"`

	// TLS connects to Redis over TLS, verifying its certificate against
	// the system roots. Default: false.
	TLS bool `json:"tls,omitempty"`

	// KeyPrefix starts every key the store writes, followed by the zone
	// name, so several zones and applications can share one Redis. It may
	// not hold { or } (the keys' Cluster hash tag). Default:
	// "caddy_rate_limit:" (as is "" in JSON; the Caddyfile refuses an empty
	// value).
	KeyPrefix string `json:"key_prefix,omitempty"`

	// Timeout bounds the Redis round trip of one decision; past it the
	// decision is made as on_error says. From 1ms to 10s. Default: 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// OnError says what happens to a request when Redis fails or times
	// out: "local" keeps limiting with a per-process memory store until
	// Redis is back (a client may then get max per instance); "allow" admits
	// the request (fail open); "deny" refuses it with 503 and Retry-After
	// (fail closed, for login and costly routes). Default: "local".
	OnError string `json:"on_error,omitempty"`

	// HashKeys, when set, is a secret: keys are written to Redis as
	// HMAC-SHA256(secret, key) in hex, so Redis holds no IP address or API
	// key, and the admin listing shows hashes. Write a placeholder such as
	// {env.RL_SECRET}. Changing it starts every key afresh. A placeholder
	// that resolves empty fails the config load. Default: none (as is "" in
	// JSON; the Caddyfile refuses an empty value, which would otherwise
	// store raw keys).
	HashKeys string `json:"hash_keys,omitempty"`

	// Pipeline is "on" to send the decisions that wait at the same moment
	// as one pipeline write per round trip (go-redis's auto-pipeliner; each
	// decision stays one atomic script), or "off" to send each on its own.
	// "on" trades safety under Redis stalls for CPU (docs/redis.md) and is
	// refused with a Cluster. Default: "off".
	Pipeline string `json:"pipeline,omitempty"`

	// Sync, when set, is sync mode's interval: each instance decides in
	// memory from the fleet's counts as last read from Redis, and every
	// interval sends the counts of the keys it touched and reads the
	// fleet's back, so no request waits for Redis. Windows are aligned to
	// the clock. From 10ms to 10s, and at most half of every window of
	// the zone; not with algorithm gcra, on_error allow or deny, or
	// pipeline on (docs/redis.md). Default: none (exact mode, a round
	// trip per decision).
	Sync caddy.Duration `json:"sync,omitempty"`

	// SyncSpend is what an instance spends between two syncs: "share"
	// (what the last sync leased it, sized by its recent demand and
	// lapsing unless renewed, and a spare share of what no lease holds,
	// so that the fleet stays within max however the requests move) or
	// "all" (everything the fleet had left at the last sync: each
	// instance may admit up to max before it hears of the others). Only
	// with sync. Default: "share".
	SyncSpend string `json:"sync_spend,omitempty"`

	// SyncTimeout bounds each round trip of a sync, apart from timeout (a
	// decision's): a sync of thousands of keys on a busy host takes longer
	// than one decision, and a sync that times out counts against the
	// zone's health. From 1ms to 10s; only with sync. Default: the sync
	// interval, and at least 1s.
	SyncTimeout caddy.Duration `json:"sync_timeout,omitempty"`

	// Set by provision: the options with placeholders replaced.
	opts     *redis.UniversalOptions
	hashKey  []byte
	connKey  string // identifies the connection config, for the client pool
	identity string // identifies the zone's counters: connection, prefix, hashing, sync
}

// Pipeline settings of the Redis store.
const (
	PipelineOn  = "on"  // concurrent decisions share round trips
	PipelineOff = "off" // each decision is its own round trip (the default)
)

// isRedis reports whether the config selects the Redis store.
func (sc *StoreConfig) isRedis() bool { return sc != nil && sc.Type == StoreRedis }

// check reports every invalid setting, naming the option and its value. It
// reads the options as written, placeholders unreplaced.
func (sc *StoreConfig) check() error {
	if sc == nil {
		return nil
	}
	var errs []error
	switch sc.Type {
	case "", StoreMemory:
		if sc.hasRedisOptions() {
			errs = append(errs, fmt.Errorf("store %q takes no options; redis options need store type %q", StoreMemory, StoreRedis))
		}
		return errors.Join(errs...)
	case StoreRedis:
	default:
		return fmt.Errorf("invalid store type %q: must be %s or %s", sc.Type, StoreMemory, StoreRedis)
	}
	if len(sc.Addresses) == 0 && sc.URL == "" {
		errs = append(errs, errors.New("redis store needs an address or a url"))
	}
	if len(sc.Addresses) > 0 && sc.URL != "" {
		// The url is not printed: it may hold a password.
		errs = append(errs, fmt.Errorf("redis store takes an address or a url, not both: got a url and address %q", sc.Addresses[0]))
	}
	for i, a := range sc.Addresses {
		if slices.Contains(sc.Addresses[:i], a) {
			errs = append(errs, fmt.Errorf("redis address %q given twice: several addresses make a Cluster client", a))
		}
		if strings.Contains(a, "{") {
			continue // a placeholder: checked once replaced, in provision
		}
		if err := checkAddress(a); err != nil {
			errs = append(errs, err)
		}
	}
	if strings.ContainsAny(sc.KeyPrefix, "{}") {
		errs = append(errs, fmt.Errorf("invalid key_prefix %q: must not hold { or }, which would break the keys' Redis Cluster hash tag", sc.KeyPrefix))
	}
	if sc.DB < 0 {
		errs = append(errs, fmt.Errorf("invalid db %d: must be 0 or more", sc.DB))
	}
	if sc.Timeout < 0 || (sc.Timeout > 0 && time.Duration(sc.Timeout) < MinRedisTimeout) {
		errs = append(errs, fmt.Errorf("invalid timeout %s: must be at least %s", time.Duration(sc.Timeout), MinRedisTimeout))
	} else if time.Duration(sc.Timeout) > MaxRedisTimeout {
		errs = append(errs, fmt.Errorf("invalid timeout %s: must be at most %s", time.Duration(sc.Timeout), MaxRedisTimeout))
	}
	switch sc.OnError {
	case "", limiter.OnErrorLocal, limiter.OnErrorAllow, limiter.OnErrorDeny:
	default:
		errs = append(errs, fmt.Errorf("invalid on_error %q: must be local, allow or deny", sc.OnError))
	}
	switch sc.Pipeline {
	case "", PipelineOff:
	case PipelineOn:
		if len(sc.Addresses) > 1 && sc.MasterName == "" {
			errs = append(errs, fmt.Errorf("invalid pipeline %q with %d addresses (a Cluster): a Cluster pipeline re-sends a node's whole batch after a connection error, counting requests twice", sc.Pipeline, len(sc.Addresses)))
		}
	default:
		errs = append(errs, fmt.Errorf("invalid pipeline %q: must be on or off", sc.Pipeline))
	}
	return errors.Join(append(errs, sc.checkSync()...)...)
}

// checkSync reports what is wrong with the sync options and the options
// sync mode gives no meaning.
func (sc *StoreConfig) checkSync() []error {
	var errs []error
	interval := time.Duration(sc.Sync)
	switch {
	case interval == 0:
		if sc.SyncSpend != "" {
			errs = append(errs, fmt.Errorf("sync_spend %q needs sync", sc.SyncSpend))
		}
		if sc.SyncTimeout != 0 {
			errs = append(errs, fmt.Errorf("sync_timeout %s needs sync", time.Duration(sc.SyncTimeout)))
		}
		return errs
	case interval < limiter.MinSyncInterval || interval > limiter.MaxSyncInterval:
		errs = append(errs, fmt.Errorf("invalid sync %s: must be from %s to %s", interval, limiter.MinSyncInterval, limiter.MaxSyncInterval))
	}
	switch sc.SyncSpend {
	case "", limiter.SyncShare, limiter.SyncAll:
	default:
		errs = append(errs, fmt.Errorf("invalid sync_spend %q: must be %s or %s", sc.SyncSpend, limiter.SyncShare, limiter.SyncAll))
	}
	if d := time.Duration(sc.SyncTimeout); d < 0 || (d > 0 && d < MinRedisTimeout) || d > MaxRedisTimeout {
		errs = append(errs, fmt.Errorf("invalid sync_timeout %s: must be from %s to %s", d, MinRedisTimeout, MaxRedisTimeout))
	}
	if sc.OnError != "" && sc.OnError != limiter.OnErrorLocal {
		errs = append(errs, fmt.Errorf("invalid on_error %q with sync: in sync mode decisions never wait for Redis and go on in memory while it fails, so on_error must be local", sc.OnError))
	}
	if sc.Pipeline == PipelineOn {
		errs = append(errs, fmt.Errorf("invalid pipeline %q with sync: sync mode sends its counts in batches of its own", sc.Pipeline))
	}
	return errs
}

// hasRedisOptions reports whether any Redis option is set.
func (sc *StoreConfig) hasRedisOptions() bool {
	return len(sc.Addresses) > 0 || sc.URL != "" || sc.MasterName != "" || sc.Username != "" ||
		sc.Password != "" || sc.DB != 0 || sc.TLS || sc.KeyPrefix != "" || sc.Timeout != 0 ||
		sc.OnError != "" || sc.HashKeys != "" || sc.Pipeline != "" || sc.Sync != 0 || sc.SyncSpend != "" || sc.SyncTimeout != 0
}

// provision fills in defaults, replaces placeholders and builds the client
// options, from settings check has passed. It connects to nothing.
func (sc *StoreConfig) provision() error {
	if !sc.isRedis() {
		return nil
	}
	if sc.KeyPrefix == "" {
		sc.KeyPrefix = DefaultRedisKeyPrefix
	}
	if sc.Timeout == 0 {
		sc.Timeout = caddy.Duration(DefaultRedisTimeout)
	}
	if sc.OnError == "" {
		sc.OnError = limiter.OnErrorLocal
	}

	repl := caddy.NewReplacer()
	opts := &redis.UniversalOptions{
		Username:   repl.ReplaceKnown(sc.Username, ""),
		Password:   repl.ReplaceKnown(sc.Password, ""),
		DB:         sc.DB,
		MasterName: repl.ReplaceKnown(sc.MasterName, ""),
	}
	for _, a := range sc.Addresses {
		addr := repl.ReplaceKnown(a, "")
		if err := checkAddress(addr); err != nil {
			return fmt.Errorf("%v (from %q)", err, a)
		}
		opts.Addrs = append(opts.Addrs, addr)
	}
	if sc.TLS {
		opts.TLSConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	}
	if sc.URL != "" {
		u := repl.ReplaceKnown(sc.URL, "")
		o, err := redis.ParseURL(u)
		if err != nil {
			return fmt.Errorf("invalid redis url (%s): %v", sc.urlSource(), redactURLError(err))
		}
		if o.DB < 0 {
			return fmt.Errorf("invalid redis url (%s): invalid db %d: must be 0 or more", sc.urlSource(), o.DB)
		}
		if err := checkAddress(o.Addr); err != nil {
			return fmt.Errorf("invalid redis url (%s): %v", sc.urlSource(), err)
		}
		opts.Addrs = []string{o.Addr}
		opts.Username, opts.Password, opts.DB, opts.TLSConfig = o.Username, o.Password, o.DB, o.TLSConfig
	}
	if len(opts.Addrs) > 1 && opts.MasterName == "" && opts.DB != 0 {
		return fmt.Errorf("invalid db %d: a Redis Cluster (several addresses) has only db 0", opts.DB)
	}
	// Every command the store sends carries a context deadline (timeout for
	// a decision), and with ContextTimeoutEnabled that deadline bounds the
	// socket reads and writes. The read and write timeouts bound them too,
	// the earlier of the two winning, so they are MaxRedisTimeout, the
	// longest timeout accepted, never below it; they still bound what the
	// client sends with no deadline of its own (a Cluster's background
	// state reloads and latency pings). Retries are off: a retried script
	// after a lost reply could count one request twice.
	opts.ContextTimeoutEnabled = true
	opts.MaxRetries = -1
	opts.DialTimeout = time.Second
	opts.DialerRetries = 1 // a refused dial is retried by the next decision, not within this one
	opts.ReadTimeout = MaxRedisTimeout
	opts.WriteTimeout = MaxRedisTimeout
	sc.opts = opts

	sc.hashKey = nil
	if sc.HashKeys != "" {
		secret := repl.ReplaceKnown(sc.HashKeys, "")
		if secret == "" {
			return fmt.Errorf("invalid hash_keys %q: the secret is empty or its placeholder is unset", sc.HashKeys)
		}
		sc.hashKey = []byte(secret)
	}

	tlsOn := opts.TLSConfig != nil
	sc.connKey = fmt.Sprintf("addrs=%s master=%s user=%s pass=%s db=%d tls=%t",
		strings.Join(opts.Addrs, ","), opts.MasterName, opts.Username, digest(opts.Password), opts.DB, tlsOn)
	sc.identity = fmt.Sprintf("redis %s prefix=%q hash_keys=%s sync=%s/%s/%s", sc.connKey, sc.KeyPrefix, digest(string(sc.hashKey)), time.Duration(sc.Sync), sc.SyncSpend, time.Duration(sc.SyncTimeout))
	return nil
}

// checkAddress reports whether addr is host:port with a host and a port
// from 1 to 65535, naming it if not.
func checkAddress(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("invalid redis address %q: must be host:port", addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > maxPort {
		return fmt.Errorf("invalid redis address %q: port must be a number from 1 to %d", addr, maxPort)
	}
	if host == "" {
		return fmt.Errorf("invalid redis address %q: the host is missing", addr)
	}
	return nil
}

// urlSource names the configured url for an error message without printing
// it, as the url may hold a password: "from {env.X}" when it is a single
// placeholder, else "redacted".
func (sc *StoreConfig) urlSource() string {
	u := sc.URL
	if len(u) > 2 && u[0] == '{' && u[len(u)-1] == '}' && !strings.ContainsAny(u[1:len(u)-1], "{}") {
		return "from " + u
	}
	return "redacted"
}

// redactURLError returns the cause of a url parse error without the url,
// which url.Error quotes in full, password included. An invalid escape is
// not quoted either: it may be part of the password.
func redactURLError(err error) error {
	var ue *url.Error
	if errors.As(err, &ue) {
		err = ue.Err
	}
	var ee url.EscapeError
	if errors.As(err, &ee) {
		return errors.New("invalid URL escape")
	}
	return err
}

// describe names the store for an error message, without secrets.
func (sc *StoreConfig) describe() string {
	if !sc.isRedis() {
		return StoreMemory
	}
	return fmt.Sprintf("redis(addresses=%s url=%t master_name=%s db=%d tls=%t key_prefix=%q timeout=%s on_error=%s hash_keys=%t pipeline=%s sync=%s sync_spend=%s sync_timeout=%s)",
		strings.Join(sc.Addresses, ","), sc.URL != "", sc.MasterName, sc.DB, sc.TLS, sc.KeyPrefix,
		time.Duration(sc.Timeout), sc.OnError, sc.HashKeys != "", sc.Pipeline, time.Duration(sc.Sync), sc.SyncSpend, time.Duration(sc.SyncTimeout))
}

// digest is a short fingerprint of a secret, so that a key naming a
// connection never holds the secret itself.
func digest(secret string) string {
	if secret == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(secret))
	return hex.EncodeToString(sum[:8])
}

// redisClient is a pooled client and its warm-up; the pool closes it when
// the last zone using it is gone.
type redisClient struct {
	redis.UniversalClient
	warm *limiter.Warmup
}

// Destruct closes the client.
func (c redisClient) Destruct() error { return c.Close() }

// loadRedisClient returns the shared client for the config and its warm-up,
// creating them if needed; it does not connect, since it runs in Provision
// (for caddy validate too). The warm-up starts at the first decision of a
// zone using the client, and the decisions that arrive before it ends wait
// for it (limiter.Warmup). Release the client with releaseRedisClient.
func loadRedisClient(sc *StoreConfig) (redis.UniversalClient, *limiter.Warmup) {
	c, _, _ := redisClients.LoadOrNew(sc.connKey, func() (caddy.Destructor, error) {
		client := redis.NewUniversalClient(sc.opts)
		return redisClient{client, limiter.NewWarmup(client)}, nil
	})
	rc := c.(redisClient)
	return rc.UniversalClient, rc.warm
}

// releaseRedisClient lets go of the client for connKey.
func releaseRedisClient(connKey string) error {
	_, err := redisClients.Delete(connKey)
	return err
}

// newRedisStore builds the Redis store of zone: its counters under the key
// prefix and the zone's name, through the client shared by every zone of
// the same connection config, which the returned func lets go of.
func (sc *StoreConfig) newRedisStore(zone string, maxTracked int, clk clock.Clock, logger *zap.Logger) (limiter.Store, func() error) {
	client, warm := loadRedisClient(sc)
	opts := limiter.RedisStoreOptions{
		Client:      client,
		Warmup:      warm,
		Prefix:      sc.KeyPrefix + zone + ":",
		HashKey:     sc.hashKey,
		MaxTracked:  maxTracked,
		Logger:      logger.With(zap.String("zone", zone)),
		Pipeline:    sc.Pipeline == PipelineOn,
		Sync:        time.Duration(sc.Sync),
		SyncSpend:   sc.SyncSpend,
		SyncTimeout: time.Duration(sc.SyncTimeout),
		Clock:       clk,
	}
	var rs limiter.Store
	if opts.Sync > 0 {
		rs = limiter.NewSyncStore(opts)
	} else {
		rs = limiter.NewRedisStore(opts)
	}
	connKey := sc.connKey
	return rs, func() error { return releaseRedisClient(connKey) }
}

// Interface guards
var _ caddy.Destructor = redisClient{}
