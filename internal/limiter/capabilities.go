package limiter

import (
	"context"
	"time"
)

// What only some stores do, as small interfaces a caller asks a Store for
// with a type assertion: the caller never needs to know which store it has.

// Runner is a store with background work (sweeping expired windows,
// health probes), which runs until ctx ends; interval says how often to
// sweep.
type Runner interface {
	Run(ctx context.Context, interval func() time.Duration)
}

// Tunable is a store whose bounds and limit names a reload may change
// while it keeps its counts.
type Tunable interface {
	// SetMaxTracked bounds the keys the store tracks.
	SetMaxTracked(n int)
	// SetSlotName names the limit counted in slot, for listings.
	SetSlotName(slot int, name string)
}

// LimitsTunable is a store that needs a zone's limits outside decisions
// (Redis: for listing keys and cutting windows by name).
type LimitsTunable interface {
	SetLimits(limits []Check)
}

// FailurePolicy is a store that can fail (Redis): how long a decision may
// take, and what happens when it fails (OnErrorLocal, OnErrorAllow,
// OnErrorDeny).
type FailurePolicy interface {
	SetTimeout(d time.Duration)
	SetOnError(mode string)
	OnError() string
}

// HealthReporter is a store with a health state: "HEALTHY", "DEGRADED" or
// "RECOVERING".
type HealthReporter interface {
	Health() string
	Healthy() bool
	Degraded() bool
}

// SlotCutter is a store that cuts, at once, the running windows of one
// slot that end after cutoff (a reload shortened the window), and clears a
// slot whose counts mean nothing under the new algorithm.
type SlotCutter interface {
	CutWindows(slot int, cutoff time.Time)
	ClearSlot(slot int)
}

// SharedCutter is a store shared with other processes (Redis) that cuts
// running windows on request: a caller does it once it serves, so that a
// config only validated cuts nothing.
type SharedCutter interface {
	CutWindows(ctx context.Context, c Check, cutoff time.Time) error
}

// Evicter is a store that evicts live keys when full, and counts them.
type Evicter interface {
	Evictions() uint64
}

// KeyCounter is a store whose keys are counted elsewhere (Redis): Len
// counts only this process's part.
type KeyCounter interface {
	CountKeys(ctx context.Context) KeyCount
}

// KeyHasher is a store that keeps keys as hashes (hash_keys): Tag gives a
// key's stored form.
type KeyHasher interface {
	HashedKeys() bool
	Tag(key string) string
}

// Leaser is a store that takes WebSocket leases shared by a fleet.
type Leaser interface {
	AcquireLease(ctx context.Context, key string, maxOpen int, ttl time.Duration) (Lease, bool, error)
	RenewLease(ctx context.Context, l Lease, ttl time.Duration) (lost bool, err error)
	ReleaseLease(ctx context.Context, l Lease) error
}

// Syncer is a store that may run in sync mode (Redis): ok is false when it
// does not.
type Syncer interface {
	SyncStats(now time.Time) (st SyncStats, ok bool)
}

// Run runs the memory store's sweeper: MemoryStore is a Runner.
func (s *MemoryStore) Run(ctx context.Context, interval func() time.Duration) {
	s.RunSweeper(ctx, interval)
}

// Interface guards
var (
	_ Runner         = (*MemoryStore)(nil)
	_ Tunable        = (*MemoryStore)(nil)
	_ SlotCutter     = (*MemoryStore)(nil)
	_ Evicter        = (*MemoryStore)(nil)
	_ RangeSizer     = (*MemoryStore)(nil)
	_ Runner         = (*RedisStore)(nil)
	_ Tunable        = (*RedisStore)(nil)
	_ LimitsTunable  = (*RedisStore)(nil)
	_ FailurePolicy  = (*RedisStore)(nil)
	_ HealthReporter = (*RedisStore)(nil)
	_ SharedCutter   = (*RedisStore)(nil)
	_ KeyCounter     = (*RedisStore)(nil)
	_ KeyHasher      = (*RedisStore)(nil)
	_ Leaser         = (*RedisStore)(nil)
	_ Syncer         = (*RedisStore)(nil)
)
