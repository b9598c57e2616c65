package limiter

import (
	"context"
	"errors"
	"time"
)

// What only a store shared by a fleet of instances does, as interfaces a
// caller asks a Store for with a checked type assertion: the caller never
// needs to know which store it has.

// Fleet is a store that the instances of a fleet share (Redis): it can
// fail, so it has a health and an on_error mode; its keys are counted
// where they live; and it takes the WebSocket leases the fleet shares.
type Fleet interface {
	Store

	// Health returns HealthHealthy, HealthDegraded or HealthRecovering;
	// Healthy and Degraded tell the first two apart without a string.
	Health() string
	Healthy() bool
	Degraded() bool

	// OnError returns what the store does when its backend fails:
	// OnErrorLocal, OnErrorAllow or OnErrorDeny.
	OnError() string

	// CountKeys counts the zone's keys where they live (Len counts only
	// this process's part).
	CountKeys(ctx context.Context) KeyCount

	// AcquireLease takes one of key's maxOpen WebSocket slots for ttl,
	// fleet-wide; got is false when all are taken. RenewLease extends a
	// lease by ttl (lost: the backend had lost it, and it was taken
	// again); ReleaseLease gives it back.
	AcquireLease(ctx context.Context, key string, maxOpen int, ttl time.Duration) (l Lease, got bool, err error)
	RenewLease(ctx context.Context, l Lease, ttl time.Duration) (lost bool, err error)
	ReleaseLease(ctx context.Context, l Lease) error
}

// Syncer is a Fleet store in sync mode: it decides in memory and syncs
// its counts with the fleet's every interval.
type Syncer interface {
	Fleet

	// SyncStats returns the sync loop's figures at now.
	SyncStats(now time.Time) SyncStats
}

// Overrider is a Fleet store that keeps the zone's per-key overrides
// where every instance reads them (Redis). The limiter stores each as the
// zone wrote it, under the tag of its key (Store.Tag), and parses none.
type Overrider interface {
	Fleet

	// SetOverride stores value as the override of the key tagged tag,
	// unless the zone keeps most overrides already and none of them is
	// the tag's (ErrTooManyOverrides), and announces the change.
	SetOverride(ctx context.Context, tag string, value []byte, most int) error
	// DeleteOverrides removes the overrides of tags, announces the change
	// when there was one, and returns how many it removed.
	DeleteOverrides(ctx context.Context, tags ...string) (int, error)
	// Overrides returns every override of the zone, by tag.
	Overrides(ctx context.Context) (map[string]string, error)
	// WatchOverrides sets the function called whenever the overrides may
	// have changed: an instance set or removed one, or this instance
	// subscribed to the announcements anew and may have missed some.
	WatchOverrides(fn func())
}

// ErrTooManyOverrides is SetOverride's error when the zone keeps as many
// overrides as it may.
var ErrTooManyOverrides = errors.New("too many overrides")
