package limiter

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// On Redis a sliding calendar window's count key expires the next window
// after its own ends, and a key of the window before (its time to live is
// what is left of this one) is read as the previous count: the script
// tells them apart from the calendar, not from the key's first request.
func TestRedisCalendarSliding(t *testing.T) {
	srv := redistest.Start(t)
	s, client := newTestRedisStore(t, []string{srv.Addr}, RedisStoreOptions{})
	listening(t, s, client)
	ctx := context.Background()
	cal := &Calendar{Unit: CalendarHour, Loc: time.UTC}
	lim := Limit{Window: time.Hour, Max: 5, Algorithm: SlidingWindow, Calendar: cal}
	now := time.Now()
	end := time.Unix(0, cal.End(now.UnixNano()))
	for i := 1; i <= 3; i++ {
		v, err := s.Hit(ctx, "10.0.0.1", now, lim)
		if err != nil || !v.Allowed || v.Remaining != 5-i || !v.Reset.Equal(end) {
			t.Fatalf("hit %d: %+v (%v), want admitted with %d left until %s", i, v, err, 5-i, end)
		}
	}
	key := "test:" + t.Name() + ":{10.0.0.1}:c"
	left := time.Until(end)
	ttl, err := client.PTTL(ctx, key).Result()
	if err != nil || ttl < left+time.Hour-2*time.Second || ttl > left+time.Hour+time.Second {
		t.Fatalf("the count key expires in %s (%v), want what is left of the hour and the next hour, %s", ttl, err, left+time.Hour)
	}
	// As if the 3 were counted in the hour before: the key expires when
	// this hour ends.
	if err := client.PExpire(ctx, key, left).Err(); err != nil {
		t.Fatal(err)
	}
	now = time.Now()
	v, err := s.Hit(ctx, "10.0.0.1", now, lim)
	weighs := 3 * float64(time.Until(end)) / float64(time.Hour)
	want := 5 - int(math.Ceil(weighs+1))
	if err != nil || !v.Allowed || (v.Remaining != want && math.Abs(weighs-math.Round(weighs)) > 0.01) {
		t.Fatalf("after the roll: %+v (%v), want admitted with %d left (the previous 3 weigh %.2f)", v, err, want, weighs)
	}
	if n, err := client.Get(ctx, key).Int(); err != nil || n != 1 {
		t.Errorf("the window's count is %d (%v), want 1: the 3 are the previous window's", n, err)
	}
}
