-- The decision script of the common case: one fixed-window limit that does
-- not ban. It follows redis.lua's rules for that case exactly, with the same
-- 8 results, in little more than half Redis's time: no tables, no parsing,
-- and no read of the count. It adds the cost first and takes it back when
-- the limit refuses, so an admitted request in a running window costs Redis
-- two calls (PTTL, INCRBY), and a refusal writes the count twice (refusals
-- are rare here: a refused key is refused in-process until its window ends).
--
--   KEYS[1] count key, KEYS[2] refused key
--   ARGV: max; window in milliseconds; cutoff (as in redis.lua); cost
--
-- Redis runs this for nearly every decision, so it does little besides its
-- calls: an admitted request in a running window turns two arguments into
-- numbers (max and window; the cutoff only when it is needed), passes the
-- cost and the window to Redis as the strings they came as, and makes no
-- closure: each conversion and closure is work Redis does per decision.

local c, r = KEYS[1], KEYS[2]
local max, window, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[4]
local ttl = redis.call('PTTL', c)
if ttl > window + 100 then
	-- A window begun under a longer window: a reload shortened it.
	-- (Windows are whole seconds; the 100 ms spare a calendar window,
	-- whose window is what is left of it by each instance's clock, the
	-- instances' skew and their rounding.)
	local cutoff = tonumber(ARGV[3])
	if cutoff <= 0 then
		redis.call('DEL', c, r)
		ttl = -2
	elseif cutoff < ttl then
		redis.call('PEXPIRE', c, cutoff)
		redis.call('PEXPIRE', r, cutoff)
		ttl = cutoff
	end
end
local count = redis.pcall('INCRBY', c, cost)
if type(count) == 'table' then
	-- Out of memory (this is the first write Redis can refuse for it)
	-- and the like fail the decision, which has written nothing. Else the
	-- count key holds no integer (damaged: see redis.lua), and the window
	-- starts now.
	local m = count.err
	if string.sub(m, 1, 9) ~= 'WRONGTYPE' and string.find(m, 'not an integer', 1, true) == nil and string.find(m, 'overflow', 1, true) == nil then
		return count
	end
	redis.call('DEL', c, r)
	ttl = -2
	count = redis.call('INCRBY', c, cost)
elseif ttl > 0 and count > 2e9 and count - cost > 2e9 then
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
		redis.call('PEXPIRE', c, ARGV[2])
		redis.call('DEL', r)
	end
	return {1, count, left, 0, 0, 0, 0, 0}
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
	refused = redis.pcall('INCR', r)
	if type(refused) == 'table' then
		-- A damaged tally (this script's writes came first: no error
		-- here is out of memory) starts again.
		redis.call('SET', r, 1)
		refused = 1
	end
	redis.call('PEXPIRE', r, left)
end
return {0, count, left, refused, 0, 0, 0, 0}
