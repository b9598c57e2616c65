-- One fixed-window decision over one or more limits, atomically. The
-- handler's verdict rules are the memory store's: the request is admitted
-- when every limit admits it, and then each count goes up by one; otherwise
-- no count goes up, and each limit that refuses tallies a refusal in a
-- second key that expires with its window. A limit's two keys carry one hash
-- tag, so they share a Cluster slot (the store sends only keys of one slot).
--
-- For check i (from 1):
--   KEYS[2i-1]  count key       KEYS[2i]  refused key
--   ARGV[3i-2]  max             ARGV[3i-1]  window in milliseconds
--   ARGV[3i]    cutoff: milliseconds from now at which a window begun under a
--               longer window (a reload shortened it) ends at the latest; at
--               or below 0 it has ended
-- Returns, for check i, {allowed (1|0), count, milliseconds to reset,
-- refused} at 4i-3 to 4i.
local n = #KEYS / 2
local counts, ttls, fresh = {}, {}, {}
local admit = true
for i = 1, n do
	local c, r = KEYS[2 * i - 1], KEYS[2 * i]
	local max, window, cutoff = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1]), tonumber(ARGV[3 * i])
	local ttl = redis.call('PTTL', c)
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
	-- ttl is -2 for a new window and -1 for a count key without an expiry
	-- (never written by this script): either way the window starts now, so
	-- no key outlives its window, and a refused tally left from an earlier
	-- window goes.
	fresh[i] = ttl < 0
	if fresh[i] then
		ttl = window
	end
	ttls[i] = ttl
	counts[i] = tonumber(redis.call('GET', c) or '0')
	if counts[i] >= max then
		admit = false
	end
end
-- Past the cuts above, the first write is one that Redis refuses when out of
-- memory, so that an OOM Redis fails the decision instead of half-making it.
local out = {}
for i = 1, n do
	local c, r = KEYS[2 * i - 1], KEYS[2 * i]
	local max, window = tonumber(ARGV[3 * i - 2]), tonumber(ARGV[3 * i - 1])
	local ok = counts[i] < max
	local refused = 0
	if admit then
		counts[i] = redis.call('INCR', c)
		if fresh[i] then
			redis.call('PEXPIRE', c, window)
			redis.call('DEL', r)
		end
	elseif not ok then
		if fresh[i] then
			redis.call('PEXPIRE', c, window)
			redis.call('SET', r, 1, 'PX', ttls[i])
			refused = 1
		else
			refused = redis.call('INCR', r)
			redis.call('PEXPIRE', r, ttls[i])
		end
	end
	out[4 * i - 3] = ok and 1 or 0
	out[4 * i - 2] = counts[i]
	out[4 * i - 1] = ttls[i]
	out[4 * i] = refused
end
return out
