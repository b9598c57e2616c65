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
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
local ttl
if count < max then
	count = redis.call('INCR', KEYS[1])
	if count == 1 then
		redis.call('PEXPIRE', KEYS[1], window)
		ttl = window
	else
		ttl = redis.call('PTTL', KEYS[1])
		if ttl < 0 then -- never let a key outlive its window
			redis.call('PEXPIRE', KEYS[1], window)
			ttl = window
		end
	end
	return {1, count, ttl, 0}
end
ttl = redis.call('PTTL', KEYS[1])
if ttl < 0 then
	redis.call('PEXPIRE', KEYS[1], window)
	ttl = window
end
local refused = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ttl)
return {0, count, ttl, refused}
