-- One decision over one or more limits, atomically. The handler's verdict
-- rules are the memory store's: the request is admitted when every limit
-- admits it, and then each count goes up by one; otherwise no count goes up,
-- and each limit that refuses tallies a refusal in a key that expires with
-- its window. A limit's keys carry one hash tag, so they share a Cluster
-- slot (the store sends only keys of one slot).
--
-- For check i (from 1):
--   KEYS[3i-2]  count key   KEYS[3i-1]  refused key   KEYS[3i]  previous count key
--   ARGV[4i-3]  max         ARGV[4i-2]  window in milliseconds
--   ARGV[4i-1]  cutoff: milliseconds from now at which a fixed window begun
--               under a longer window (a reload shortened it) ends at the
--               latest; at or below 0 it has ended
--   ARGV[4i]    1 for the sliding-window counter, 0 for a fixed window
-- Returns, for check i, {allowed (1|0), count, milliseconds to the end of
-- the window, refused, previous window's count} at 5i-4 to 5i.
--
-- A fixed window is its count key, expiring when the window ends. A sliding
-- window's count key expires a window after its window ends, so that it can
-- serve as the previous count: while its time to live is over a window it
-- counts the window in progress (and the previous count key, expiring with
-- that window, holds the one before); once under, its window has ended and
-- the window in progress began at that end.
local n = #KEYS / 3
local counts, prevs, lefts, states = {}, {}, {}, {}
local admit = true
for i = 1, n do
	local c, r, p = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
	local max, window = tonumber(ARGV[4 * i - 3]), tonumber(ARGV[4 * i - 2])
	local cutoff, sliding = tonumber(ARGV[4 * i - 1]), ARGV[4 * i] == '1'
	local ttl = redis.call('PTTL', c)
	local ok
	if sliding then
		prevs[i] = 0
		counts[i] = 0
		if ttl > window then
			states[i] = 'current'
			-- At most a window: a reload that shortened the window leaves
			-- a longer time to live, which must not weigh the previous
			-- count above one.
			lefts[i] = math.min(ttl - window, window)
			counts[i] = tonumber(redis.call('GET', c) or '0')
			prevs[i] = tonumber(redis.call('GET', p) or '0')
		elseif ttl > 0 then
			states[i] = 'roll'
			lefts[i] = ttl
			prevs[i] = tonumber(redis.call('GET', c) or '0')
		else
			states[i] = 'new'
			lefts[i] = window
		end
		ok = prevs[i] * lefts[i] / window + counts[i] + 1 <= max
	else
		prevs[i] = 0
		if ttl > window then
			if cutoff <= 0 then
				redis.call('DEL', c, r)
				ttl = -2
			elseif cutoff < ttl then
				redis.call('PEXPIRE', c, cutoff)
				redis.call('PEXPIRE', r, cutoff)
				ttl = cutoff
			end
		end
		-- ttl is -2 for a new window and -1 for a count key without an
		-- expiry (never written by this script): either way the window
		-- starts now, so no key outlives its window, and a refused tally
		-- left from an earlier window goes.
		if ttl < 0 then
			states[i] = 'new'
			ttl = window
		else
			states[i] = 'current'
		end
		lefts[i] = ttl
		counts[i] = tonumber(redis.call('GET', c) or '0')
		ok = counts[i] < max
	end
	if not ok then
		admit = false
	end
	states[i] = {states[i], ok, sliding}
end
-- Past the cuts above, the first write is one that Redis refuses when out of
-- memory, so that an OOM Redis fails the decision instead of half-making it.
local out = {}
for i = 1, n do
	local c, r, p = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
	local window = tonumber(ARGV[4 * i - 2])
	local state, ok, sliding = states[i][1], states[i][2], states[i][3]
	local left = lefts[i]
	local refused = 0
	if sliding and state ~= 'current' and (admit or not ok) then
		-- Start the window in progress: the previous count moves over.
		local start = 0
		if admit then
			start = 1
		end
		redis.call('SET', c, start, 'PX', left + window)
		if state == 'roll' then
			redis.call('SET', p, prevs[i], 'PX', left)
		else
			redis.call('DEL', p)
		end
		counts[i] = start
		if not ok then
			redis.call('SET', r, 1, 'PX', left)
			refused = 1
		else
			redis.call('DEL', r)
		end
	elseif admit then
		counts[i] = redis.call('INCR', c)
		if state == 'new' then
			redis.call('PEXPIRE', c, window)
			redis.call('DEL', r)
		end
	elseif not ok then
		if state == 'new' then
			redis.call('PEXPIRE', c, window)
			redis.call('SET', r, 1, 'PX', left)
			refused = 1
		else
			refused = redis.call('INCR', r)
			redis.call('PEXPIRE', r, left)
		end
	end
	out[5 * i - 4] = ok and 1 or 0
	out[5 * i - 3] = counts[i]
	out[5 * i - 2] = left
	out[5 * i - 1] = refused
	out[5 * i] = prevs[i]
end
return out
