package tests

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-rate-limit/caddy-rate-limit/internal/clock"
	"github.com/caddy-rate-limit/caddy-rate-limit/internal/redistest"
)

// calendarSite limits each X-Client to 2 requests an hour, from :00 to
// :00, with the store block store ("" for memory).
func calendarSite(zone, store string) string {
	return fmt.Sprintf(`
:$PORT {
	rate_limit {
		zone %s
		key {http.request.header.X-Client}
		window hour
		max 2
		%s
	}
	respond "ok"
}`, zone, store)
}

// An hourly calendar window refuses until the next :00, and says so in
// Retry-After and X-RateLimit-Reset; at :00 a new window admits again.
func TestCalendarHourEndToEnd(t *testing.T) {
	zone := fresh("e2e-calendar")
	clk := fakeClock(t, zone)
	next := clk.Now().UTC().Truncate(time.Hour).Add(2 * time.Hour) // a :00 ahead (the clock never goes back)
	clk.Set(next.Add(-30 * time.Second))
	s := startCaddy(t, "", calendarSite(zone, ""))
	for range 2 {
		if resp, _ := s.get("/", "X-Client", "c1"); resp.StatusCode != http.StatusOK {
			t.Fatalf("within the hour's 2: %d", resp.StatusCode)
		}
	}
	resp, _ := s.get("/", "X-Client", "c1")
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "30" || resp.Header.Get("X-RateLimit-Reset") != strconv.FormatInt(next.Unix(), 10) {
		t.Fatalf("the third at :59:30: %d, Retry-After %q, X-RateLimit-Reset %q; want 429 until %s",
			resp.StatusCode, resp.Header.Get("Retry-After"), resp.Header.Get("X-RateLimit-Reset"), next.Format(time.RFC3339))
	}
	clk.Advance(30 * time.Second)
	resp, _ = s.get("/", "X-Client", "c1")
	if resp.StatusCode != http.StatusOK || resp.Header.Get("X-RateLimit-Reset") != strconv.FormatInt(next.Unix()+3600, 10) || resp.Header.Get("X-RateLimit-Remaining") != "1" {
		t.Errorf("at :00: %d, X-RateLimit-Reset %q, remaining %q; want a new window to 16:00", resp.StatusCode, resp.Header.Get("X-RateLimit-Reset"), resp.Header.Get("X-RateLimit-Remaining"))
	}
}

// hourClock returns the clock of zone: the time now, or in the last half
// of an hour that ends at next(now), just past its end, so that at least
// half an hour of the window is left, with no sleep; it is never more than
// half an hour ahead of Redis's clock, as sync mode's script needs. It
// returns the end of the hour the clock is in.
func hourClock(t *testing.T, zone string, next func(time.Time) time.Time) (*clock.Fake, time.Time) {
	t.Helper()
	clk := fakeClock(t, zone)
	end := next(clk.Now())
	if end.Sub(clk.Now()) < 30*time.Minute {
		clk.Set(end.Add(time.Second))
		end = end.Add(time.Hour)
	}
	return clk, end
}

// On Redis the window's end travels with the count: the count key expires
// at the next :00, whichever instance began it.
func TestCalendarHourRedis(t *testing.T) {
	srv := redistest.Start(t)
	zone := fresh("e2e-calendar-redis")
	clk, next := hourClock(t, zone, func(t time.Time) time.Time { return t.Truncate(time.Hour).Add(time.Hour) })
	s := startCaddy(t, "", calendarSite(zone, "store redis {\n\t\t\taddress "+srv.Addr+"\n\t\t}"))
	for range 2 {
		if resp, _ := s.get("/", "X-Client", "c1"); resp.StatusCode != http.StatusOK {
			t.Fatalf("within the hour's 2: %d", resp.StatusCode)
		}
	}
	resp, _ := s.get("/", "X-Client", "c1")
	retry, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
	left := int(next.Sub(clk.Now()) / time.Second)
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("X-RateLimit-Reset") != strconv.FormatInt(next.Unix(), 10) || retry < left-2 || retry > left+1 {
		t.Fatalf("the third: %d, Retry-After %d, X-RateLimit-Reset %q; want 429 until %s (%d s)",
			resp.StatusCode, retry, resp.Header.Get("X-RateLimit-Reset"), next.Format(time.RFC3339), left)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ttl, err := rdb.PTTL(context.Background(), "caddy_rate_limit:"+zone+":{key:c1}:c").Result()
	if err != nil || ttl < time.Duration(left-2)*time.Second || ttl > time.Duration(left+1)*time.Second {
		t.Errorf("the count key expires in %s (%v), want at the next :00, %d s on", ttl, err, left)
	}
}

// In sync mode the instances agree on a calendar window's end from the
// calendar: in Asia/Kolkata (+05:30) an hour runs from :30 UTC, and the
// hash of the window's counts outlives it by the next hour.
func TestCalendarHourSync(t *testing.T) {
	srv := redistest.Start(t)
	zone := fresh("e2e-calendar-sync")
	clk, next := hourClock(t, zone, func(t time.Time) time.Time { return t.Add(-30 * time.Minute).Truncate(time.Hour).Add(90 * time.Minute) }) // the next :30
	s := startCaddy(t, "", calendarSite(zone, "time_zone Asia/Kolkata\n\t\tstore redis {\n\t\t\taddress "+srv.Addr+"\n\t\t\tsync 100ms\n\t\t}"))
	for range 2 {
		if resp, _ := s.get("/", "X-Client", "c1"); resp.StatusCode != http.StatusOK || resp.Header.Get("X-RateLimit-Reset") != strconv.FormatInt(next.Unix(), 10) {
			t.Fatalf("within the hour's 2: %d, X-RateLimit-Reset %q, want the window to %s", resp.StatusCode, resp.Header.Get("X-RateLimit-Reset"), next.Format(time.RFC3339))
		}
	}
	if resp, _ := s.get("/", "X-Client", "c1"); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("the third: %d, want 429", resp.StatusCode)
	}
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	// The window's hash of counts is named by its end and length.
	key := "caddy_rate_limit:" + zone + ":w:{0}:" + strconv.FormatInt(next.UnixMilli(), 10) + ":" + strconv.FormatInt(time.Hour.Milliseconds(), 10)
	var ttl time.Duration
	if !eventuallyAcross(func() bool {
		clk.Advance(100 * time.Millisecond) // the next sync round
		ttl, _ = rdb.PTTL(context.Background(), key).Result()
		return ttl > 0 && rdb.HExists(context.Background(), key, "caddy_rate_limit:"+zone+":{key:c1}:g").Val()
	}) {
		t.Fatalf("no round sent the count: PTTL %s", ttl)
	}
	// Redis's clock reads the real time: the key expires an hour past
	// next by it.
	if want := time.Until(next) + time.Hour; ttl < want-2*time.Second || ttl > want+time.Second {
		t.Errorf("the hash of counts expires in %s, want %s: at the next :30 and an hour", ttl, want)
	}
}
