package ratelimit

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
)

// The zone list of the admin API, and finding the live zones. What each
// zone tells of itself is in zone_read.go.

// listZones describes every zone a loaded config names, sorted by name.
// The zones are described concurrently, so that the list waits for the
// counts of several Redis zones (trackedKeysWait each) at once, not in turn.
func listZones(ctx context.Context) []ZoneInfo {
	live := liveZones()
	out := make([]ZoneInfo, len(live))
	var wg sync.WaitGroup
	for i, z := range live {
		wg.Go(func() { out[i] = z.info(ctx) })
	}
	wg.Wait()
	slices.SortFunc(out, func(a, b ZoneInfo) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// liveZones returns every zone a loaded config names. It holds the pool's
// lock only to copy the pointers.
//
// A reload that moves a zone to another store holds the old zone and the new
// one under the same name for a moment; the newer one is listed.
func liveZones() []*zone {
	byName := map[string]*zone{}
	zones.Range(func(_, v any) bool {
		if z, ok := v.(*zone); ok {
			if old := byName[z.name]; old == nil || z.seq > old.seq {
				byName[z.name] = z
			}
		}
		return true
	})
	return slices.Collect(maps.Values(byName))
}

// findZone returns the zone called name, or nil if no loaded config names it.
func findZone(name string) *zone {
	var found *zone
	zones.Range(func(_, v any) bool {
		if z, ok := v.(*zone); ok && z.name == name && (found == nil || z.seq > found.seq) {
			found = z
		}
		return true
	})
	return found
}
