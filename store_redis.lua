-- One fixed-window decision, atomically. The handler's verdict rules are the
-- memory store's: a refused request is not added to the count (it never
-- extends a lockout) but is tallied in a second key that expires with the
-- window. Both keys carry one hash tag, so they share a Cluster slot.
--
-- KEYS[1]  count key    KEYS[2]  refused key
-- ARGV[1]  max          ARGV[2]  window in milliseconds
-- ARGV[3]  cutoff: milliseconds from now at which a window begun under a
--          longer window (a reload shortened it) ends at the latest; at or
--          below 0 it has ended
-- Returns {allowed (1|0), count, milliseconds to reset, refused}.
local max = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local cutoff = tonumber(ARGV[3])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > window then
	if cutoff <= 0 then
		redis.call('DEL', KEYS[1], KEYS[2])
		ttl = -2
	elseif cutoff < ttl then
		redis.call('PEXPIRE', KEYS[1], cutoff)
		redis.call('PEXPIRE', KEYS[2], cutoff)
		ttl = cutoff
	end
end
-- ttl is -2 for a new window and -1 for a count key without an expiry (never
-- written by this script): either way the window starts now, so no key
-- outlives its window, and a refused tally left from an earlier window goes.
-- Past the cut above, the first write is one that Redis refuses when out of
-- memory, so that an OOM Redis fails the decision instead of half-making it.
local fresh = ttl < 0
if fresh then
	ttl = window
end
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
if count < max then
	count = redis.call('INCR', KEYS[1])
	if fresh then
		redis.call('PEXPIRE', KEYS[1], window)
		redis.call('DEL', KEYS[2])
	end
	return {1, count, ttl, 0}
end
local refused
if fresh then
	redis.call('PEXPIRE', KEYS[1], window)
	redis.call('SET', KEYS[2], 1, 'PX', ttl)
	refused = 1
else
	refused = redis.call('INCR', KEYS[2])
	redis.call('PEXPIRE', KEYS[2], ttl)
end
return {0, count, ttl, refused}
