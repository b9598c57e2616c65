package ratelimit

import "sync"

// The zone's count of the WebSockets open through it, per key
// (ws_max_connections_per_ip in this process).

// wsConns counts the WebSockets open through one zone, per key. It lives in
// the zone, so the counts survive config reloads as the zone's request
// counters do. Its zero value is ready to use; it is safe for concurrent use.
type wsConns struct {
	mu   sync.Mutex
	live map[string]int // key → open sockets; a key at 0 is deleted
}

// wsAcquire takes one of key's WebSocket slots unless it already has
// maxOpen sockets open (0: no cap). On success it returns a release function
// that gives the slot back; calling it again does nothing, so the slot is
// given back exactly once.
func (z *zone) wsAcquire(key string, maxOpen int) (release func(), ok bool) {
	c := &z.ws
	c.mu.Lock()
	n := c.live[key]
	if maxOpen > 0 && n >= maxOpen {
		c.mu.Unlock()
		return nil, false
	}
	if c.live == nil {
		c.live = make(map[string]int)
	}
	c.live[key] = n + 1
	c.mu.Unlock()
	z.wsLive.Add(1)

	var once sync.Once
	return func() { once.Do(func() { z.wsRelease(key) }) }, true
}

// wsRelease gives back one of key's WebSocket slots.
func (z *zone) wsRelease(key string) {
	c := &z.ws
	c.mu.Lock()
	if n := c.live[key]; n > 1 {
		c.live[key] = n - 1
	} else {
		delete(c.live, key)
	}
	c.mu.Unlock()
	z.wsLive.Add(-1)
}

// wsOpen returns the number of WebSockets key has open through the zone.
func (z *zone) wsOpen(key string) int {
	z.ws.mu.Lock()
	defer z.ws.mu.Unlock()
	return z.ws.live[key]
}
