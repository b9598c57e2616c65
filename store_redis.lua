-- One fixed-window decision, atomically. The handler's verdict rules are the
-- memory store's: a refused request is not added to the count (it never
-- extends a lockout) but is tallied in a second key that expires with the
-- window. Both keys carry one hash tag, so they share a Cluster slot.
--
-- KEYS[1]  count key    KEYS[2]  refused key
-- ARGV[1]  max          ARGV[2]  window in milliseconds
-- Returns {allowed (1|0), count, milliseconds to reset, refused}.
local max = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
-- left returns the milliseconds to the window's end, setting the expiry when
-- the key has none (so no key outlives its window) or more than one window
-- left (so a reload that shortens the window applies to running windows).
local function left()
	local ttl = redis.call('PTTL', KEYS[1])
	if ttl < 0 or ttl > window then
		redis.call('PEXPIRE', KEYS[1], window)
		ttl = window
	end
	return ttl
end
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
if count < max then
	count = redis.call('INCR', KEYS[1])
	if count == 1 then
		redis.call('PEXPIRE', KEYS[1], window)
		return {1, count, window, 0}
	end
	return {1, count, left(), 0}
end
local ttl = left()
local refused = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ttl)
return {0, count, ttl, refused}
