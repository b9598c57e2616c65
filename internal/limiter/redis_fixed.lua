-- The decision script of the common case: one fixed-window limit that does
-- not ban. It follows redis.lua's rules for that case exactly, with the same
-- 7 results, in little more than half Redis's time: no tables, no parsing,
-- and no read of the count. It adds the cost first and takes it back when
-- the limit refuses, so an admitted request in a running window costs Redis
-- two calls (PTTL, INCRBY), and a refusal writes the count twice (refusals
-- are rare here: a refused key is refused in-process until its window ends).
--
--   KEYS[1] count key, KEYS[2] refused key
--   ARGV: max; window in milliseconds; cutoff (as in redis.lua); cost
local c, r = KEYS[1], KEYS[2]
local max, window, cutoff, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ttl = redis.call('PTTL', c)
if ttl > window then
	-- A window begun under a longer window: a reload shortened it.
	if cutoff <= 0 then
		redis.call('DEL', c, r)
		ttl = -2
	elseif cutoff < ttl then
		redis.call('PEXPIRE', c, cutoff)
		redis.call('PEXPIRE', r, cutoff)
		ttl = cutoff
	end
end
local count = redis.call('INCRBY', c, cost)
if ttl > 0 and count - cost > 2e9 then
	-- A GCRA arrival time, left by a config that changed the algorithm:
	-- the window starts now.
	redis.call('DEL', c, r)
	ttl = -2
	count = redis.call('INCRBY', c, cost)
end
-- ttl is -2 for a new window and -1 for a count key without an expiry:
-- either way the window starts now.
local new = ttl < 0
local left = ttl
if new then
	left = window
end
if count <= max then
	if new then
		redis.call('PEXPIRE', c, window)
		redis.call('DEL', r)
	end
	return {1, count, left, 0, 0, 0, 0}
end
-- Refused: the count goes back to what it was (a key that did not exist
-- is removed again).
if ttl == -2 then
	redis.call('DEL', c)
	count = 0
else
	count = redis.call('DECRBY', c, cost)
end
local refused = 1
if new then
	redis.call('PEXPIRE', c, window)
	redis.call('SET', r, 1, 'PX', left)
else
	refused = redis.call('INCR', r)
	redis.call('PEXPIRE', r, left)
end
return {0, count, left, refused, 0, 0, 0}
