package limiter

import (
	"fmt"
	"testing"
	"time"
)

// Many keys that were banned once (1s bans, escalation on) keep every ban slot for a day.
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
	out, _ := decide(t, s, later, victim)
	t.Logf("new offender an hour later: RetryAfter=%v (window end would be ~1m)", out[0].RetryAfter)
	if out[0].RetryAfter < 50*time.Second || out[0].Reset.Sub(later) > 61*time.Second {
		// not banned: refused by window only; show it
	}
	var banned int
	s.shards[s.shardIndex(victim.Key, 0)].mu.Lock()
	_, ok := s.shards[s.shardIndex(victim.Key, 0)].bans[0][victim.Key]
	s.shards[s.shardIndex(victim.Key, 0)].mu.Unlock()
	if ok {
		banned = 1
	}
	if banned == 0 {
		t.Errorf("a new offender is not banned an hour after 1000 one-second bans ended (strike memory holds every slot for 24h)")
	}
}
