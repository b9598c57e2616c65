package limiter

import (
	"context"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// BenchmarkSyncRedisCost measures what sync mode costs per key synced:
// one instance, 100,000 keys each hit once per round, as per-IP limits
// are, in windows already running (share, all) or each round in a new
// window, so that every key synced is its first in its window
// (share-new-windows: a new field of a new hash). Each iteration is one
// round; redis-µs/key is the change of
// redis-server's CPU time (INFO cpu) divided by the keys the rounds sent,
// redis-bytes/key the memory Redis holds per key after them (INFO memory),
// heap-bytes/key the live heap the store holds per key after them, and
// round-µs/key this process's CPU time in the rounds (runtime/metrics,
// the collector's included) per key they sent.
func BenchmarkSyncRedisCost(b *testing.B) {
	srv := redistest.StartReal(b, "Redis's CPU time is a real redis-server's")
	const keys = 100_000
	ids := make([]string, keys)
	for i := range ids {
		ids[i] = "10." + strconv.Itoa(i>>16) + "." + strconv.Itoa(i>>8&255) + "." + strconv.Itoa(i&255)
	}
	for _, bc := range []struct {
		name, spend string
		fresh       bool // each round in the next window
	}{{SyncShare, SyncShare, false}, {SyncAll, SyncAll, false}, {"share-new-windows", SyncShare, true}} {
		spend := bc.spend
		b.Run(bc.name, func(b *testing.B) {
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			// The store's own loop does not run: the benchmark's rounds
			// are the only ones.
			s := NewSyncStore(testStoreOptions(b, []string{srv.Addr}, RedisStoreOptions{
				Sync: MaxSyncInterval, SyncSpend: spend, Clock: alignedClock(time.Minute),
				Prefix: "cost-" + bc.name + ":",
			}))
			client := s.client
			// Each run starts on an empty Redis: under -count, a run
			// would find the hashes of the one before with a field of
			// its instance, and cost more per key than one instance does.
			if err := client.FlushAll(context.Background()).Err(); err != nil {
				b.Fatal(err)
			}
			s.markUsed()
			s.table.setReady()
			lim := Limit{Window: time.Minute, Max: 1000}
			ctx := context.Background()
			mem0 := redisInfo(b, client, "memory", "used_memory")
			var ahead time.Duration // how far the rounds' windows are ahead of the clock
			hitAll := func() {
				now := s.clock.Now().Add(ahead)
				for _, id := range ids {
					if _, err := s.Hit(ctx, id, now, lim); err != nil {
						b.Fatal(err)
					}
				}
			}
			// The keys' windows start: the benchmark measures running ones.
			hitAll()
			s.syncRound(ctx, s.clock.Now())
			var cpu, round time.Duration
			var sent float64
			for b.Loop() {
				if bc.fresh {
					ahead += lim.Window
				}
				hitAll()
				cpu0, round0 := redisCPU(b, client), goCPU()
				s.syncRound(ctx, s.clock.Now().Add(ahead))
				round += goCPU() - round0
				cpu += redisCPU(b, client) - cpu0
				sent += keys
			}
			b.ReportMetric(float64(cpu.Microseconds())/sent, "redis-µs/key")
			b.ReportMetric(float64(round.Microseconds())/sent, "round-µs/key")
			if bc.fresh {
				return // Redis and the heap hold a window per round
			}
			b.ReportMetric((redisInfo(b, client, "memory", "used_memory")-mem0)/keys, "redis-bytes/key")
			runtime.GC()
			runtime.ReadMemStats(&after)
			b.ReportMetric((float64(after.HeapAlloc)-float64(before.HeapAlloc))/keys, "heap-bytes/key")
			runtime.KeepAlive(s)
		})
	}
}

// redisCPU returns the CPU time redis-server has used (INFO cpu).
func redisCPU(b *testing.B, client redis.UniversalClient) time.Duration {
	sum := redisInfo(b, client, "cpu", "used_cpu_sys") + redisInfo(b, client, "cpu", "used_cpu_user")
	return time.Duration(sum * float64(time.Second))
}

// goCPU returns the CPU time this process's Go code has used, the
// collector's included, as the runtime estimates it.
func goCPU() time.Duration {
	m := []metrics.Sample{{Name: "/cpu/classes/total:cpu-seconds"}, {Name: "/cpu/classes/idle:cpu-seconds"}}
	metrics.Read(m)
	return time.Duration((m[0].Value.Float64() - m[1].Value.Float64()) * float64(time.Second))
}

// redisInfo returns the number field of INFO section.
func redisInfo(b *testing.B, client redis.UniversalClient, section, field string) float64 {
	info, err := client.Info(context.Background(), section).Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\n") {
		if k, v, _ := strings.Cut(strings.TrimSpace(line), ":"); k == field {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				b.Fatalf("INFO %s: %s: %v", section, line, err)
			}
			return f
		}
	}
	b.Fatalf("INFO %s has no %s", section, field)
	return 0
}
