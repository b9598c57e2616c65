package limiter

import (
	"fmt"
	"testing"
	"time"
)

// A full ban table makes room for a new offender by forgetting the
// violations of bans that have ended (1000 one-second bans, escalation on).
func TestEdgeBanSlotsHeldByStrikes(t *testing.T) {
	lim := Limit{Window: time.Minute, Max: 1, Ban: time.Second, BanMax: time.Hour}
	s := NewMemoryStore(1000)
	now := time.Now()
	for i := range 1000 {
		c := Check{Key: fmt.Sprintf("10.0.%d.%d", i/256, i%256), Limit: lim}
		decide(t, s, now, c)
		decide(t, s, now, c)
	}
	later := now.Add(time.Hour) // every ban ended long ago
	s.Sweep(later)
	victim := Check{Key: "203.0.113.77", Limit: lim}
	decide(t, s, later, victim)
	decide(t, s, later, victim)
	sh := &s.shards[s.hash(victim.Key, 0)&s.mask]
	sh.mu.Lock()
	_, banned := sh.bans[0][victim.Key]
	sh.mu.Unlock()
	if !banned {
		t.Errorf("a new offender is not banned an hour after 1000 one-second bans ended (the violations of ended bans hold every slot)")
	}
}
