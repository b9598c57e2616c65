-- One batch of a sync round (store redis { sync }): for each key an
-- instance touched since its last round, it writes the instance's own count
-- of the window and reads back the fleet's. Each instance's count is a
-- field of a hash, and the count key holds their sum, so a round sent twice
-- (a reply lost to a timeout) or again after Redis lost its data (a
-- restart) writes the same figures: nothing is counted twice, and nothing
-- the instances still hold is lost. A refund (count_status) is a lower
-- count. The keys of one client share a hash tag, so a batch whose keys are
-- of one Cluster slot is one call.
--
-- Windows are aligned to the clock: every instance computes the same end
-- for the window in progress. A count key expires a window after its
-- window ends, so its time to live tells which window it counts; the
-- previous window's count stays readable (a sliding window weighs it) and
-- takes the late counts of instances that had not sent them when the
-- window ended. A count for a window older than that is never sent, and one
-- for a window Redis has already left behind is dropped (-1).
--
-- Between two rounds an instance spends only what it holds: with spend
-- share, the round reserves it a share of what no instance holds (its
-- field is "count/reserved"), so that the fleet's counts and reservations
-- never add up to more than max. An instance not yet counted in the window
-- is taken to hold its first share (max over the instances that synced
-- recently) until this one's second round of the window, when every
-- instance that touched the key before its first has had a round.
--
--   ARGV[1] now in Unix milliseconds (the instance's clock); ARGV[2] the
--   instance's id; ARGV[3] the instances that synced recently; ARGV[4] 1
--   for spend share.
-- For key i, KEYS[i] is its count key; its other keys end in another
-- letter instead of c, under the same hash tag, so in the same Cluster
-- slot: p the previous count, h and q the instances' counts of the window
-- and of the one before (hashes), r the refused tally, b the ban. ARGV[i+4]
-- holds its 9 numbers, separated by spaces: the end of the instance's
-- window (Unix ms), the window (ms), the instance's count of it, its count
-- of the previous window (-1: not sent), refusals to add to the tally, 1 to
-- read the ban, max, 1 while instances not yet counted are taken to hold
-- their first share, and the units the previous window weighs (-1: a fixed
-- window, whose previous count is not read).
-- Returns 5 values per key: the fleet's count of the window (-1: dropped,
-- the window has ended in Redis), how many instances counted in it, the
-- fleet's count of the previous window, the milliseconds left of the key's
-- ban (0: none), the units reserved to the instance (spend share).
local now, inst, fleet, share = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1'

-- num returns the integer key k holds, 0 when none.
local function num(k)
	local v = redis.pcall('GET', k)
	if type(v) == 'string' then
		return tonumber(v) or 0
	end
	return 0
end

-- others returns the other instances' counts in hash hk, summed, what
-- they hold reserved, summed, and how many they are; a key under hk that
-- is not a hash (a hand-made SET) goes.
local function others(hk)
	local all = redis.pcall('HGETALL', hk)
	if all.err then
		redis.call('DEL', hk)
		return 0, 0, 0
	end
	local total, held, n = 0, 0, 0
	for j = 1, #all, 2 do
		if all[j] ~= inst then
			local count, reserved = string.match(all[j + 1], '^(%-?%d+)/?(%d*)$')
			total = total + (tonumber(count) or 0)
			held = held + (tonumber(reserved) or 0)
			n = n + 1
		end
	end
	return total, held, n
end

-- put writes the instance's field of hash hk and the fleet's count into
-- ck, both expiring at exp (the hash keeps the expiry it has).
local function put(ck, hk, count, field, exp)
	if redis.call('HSET', hk, inst, field) == 1 then
		redis.call('PEXPIREAT', hk, exp)
	end
	redis.call('SET', ck, count, 'PXAT', exp)
end

local out = {}
for i = 1, #KEYS do
	local c = KEYS[i]
	local base = string.sub(c, 1, -2)
	local p, h, q = base .. 'p', base .. 'h', base .. 'q'
	local e, w, mine, prev, refused, bans, max, waiting, weighs = string.match(ARGV[i + 4],
		'^(%d+) (%d+) (%d+) (%-?%d+) (%d+) ([01]) (%d+) ([01]) (%-?%d+)$')
	e, w, mine, prev, refused = tonumber(e), tonumber(w), tonumber(mine), tonumber(prev), tonumber(refused)
	max, weighs = tonumber(max), tonumber(weighs)
	-- at is the window the count key counts, from the instance's: 0 the
	-- same (or none yet), -1 the one before, 1 the one after. The key
	-- expires a window after its window ends.
	local ttl, at = redis.call('PTTL', c), 0
	if ttl == -2 then
		-- No count: a new window (a previous count, if any, is the
		-- previous window's: it expires when this one ends).
	elseif ttl < 0 or 2 * ttl > 5 * w then
		-- Not this script's, or written under a longer window (a reload
		-- shortened it): the counts start afresh.
		redis.call('DEL', c, p, h, q)
		ttl = -2
	else
		at = math.floor((now + ttl - w - e) / w + 0.5)
		if at == -1 then
			-- The count becomes the previous count, and expires as it
			-- should, when the instance's window ends.
			redis.call('RENAME', c, p)
			if redis.call('EXISTS', h) == 1 then
				redis.call('RENAME', h, q)
			else
				redis.call('DEL', q)
			end
			at, ttl = 0, -2
		elseif at < -1 then
			redis.call('DEL', c, p, h, q) -- an older window
			at, ttl = 0, -2
		end
	end
	local total, n, ptotal, res = -1, 0, 0, 0
	if at == 0 then
		-- The others' counts and reservations: none in a new window.
		local counted, held = 0, 0
		if ttl ~= -2 then
			counted, held, n = others(h)
		end
		total, n = counted + mine, n + 1
		if share then
			-- This instance's share of what no other instance holds
			-- (what it held itself is free again).
			local left = max - math.max(weighs, 0)
			local free, div = left - total - held, n
			if waiting == '1' then
				local first = math.ceil(math.max(left, 0) / fleet)
				free = free - math.max(fleet - n, 0) * first
				div = math.max(fleet, n)
			end
			if free > 0 then
				res = math.ceil(free / div)
			end
		end
		put(c, h, total, mine .. '/' .. res, e + w)
		if prev >= 0 and e > now then
			ptotal = others(q) + prev
			put(p, q, ptotal, prev, e)
		elseif weighs >= 0 then
			ptotal = num(p)
		end
	elseif at == 1 then
		-- Redis counts the next window already: the instance's is the
		-- previous one (a count for the one before that is dropped).
		total = others(q) + mine
		put(p, q, total, mine, e + w)
		n = redis.call('HLEN', q)
	end
	if total >= 0 and refused > 0 then
		local r = base .. 'r'
		if type(redis.pcall('INCRBY', r, refused)) == 'table' then
			redis.call('SET', r, refused)
		end
		redis.call('PEXPIREAT', r, e)
	end
	local ban = 0
	if bans == '1' then
		ban = math.max(redis.call('PTTL', base .. 'b'), 0)
	end
	out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4], out[#out + 5] = total, n, ptotal, ban, res
end
return out
