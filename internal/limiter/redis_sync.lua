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
-- With spend share, an instance spends between two rounds what a round
-- leased it: the units it asked for (its recent demand) of what neither
-- the counts nor the other instances' live leases hold, and a spare share
-- of what is left after that (half of it divided among the instances that
-- synced recently). Its lease
-- lapses at its end unless a round renews it: capacity an instance stopped
-- using is free again within the lease's length, wherever the requests
-- went. Its field is "count/leased/until" (leased: lease and spare share;
-- until in Unix ms); a lapsed lease holds nothing. An instance not yet
-- counted in the window is taken to hold its first spare share (half of
-- what is left over the instances, see prior in redis_sync.go) until this
-- one's second round of the window, when every instance that touched the
-- key before its first has had a round.
--
--   ARGV[1] now in Unix milliseconds (the instance's clock); ARGV[2] the
--   instance's id; ARGV[3] the lease's end (Unix ms); ARGV[4] 1 for spend
--   share; ARGV[5] the instances that synced recently; ARGV[6] this one's
--   rank among them by id, from 0; ARGV[7] 1 while learning (the lease no more
--   than the pace).
-- For key i, KEYS[i] is its count key; its other keys end in another
-- letter instead of c, under the same hash tag, so in the same Cluster
-- slot: p the previous count, h and q the instances' counts of the window
-- and of the one before (hashes), r the refused tally, b the ban. ARGV[8]
-- holds every key's 12 numbers, in the order of KEYS, in one JSON array
-- (one argument for the batch, decoded in one call, not one string per
-- number): the end of the instance's
-- window (Unix ms), the length of the window after it (ms: a calendar's
-- windows vary), the instance's count of it, its count
-- of the previous window (-1: not sent), refusals to add to the tally, 1 to
-- read the ban, max, the units the instance asks to lease, the most it
-- asks while learning (twice what it spent since its last round: its pace,
-- not more), 1 when the instance wrote its count of the window before (if
-- Redis has it no more, Redis lost its state: the round leases as while
-- learning), 1 for the instance's first two rounds of the window, and the
-- units the previous window weighs (-1: a fixed window, whose previous
-- count is not read).
-- Returns 7 values per key: the fleet's count of the window (-1: dropped,
-- the window has ended in Redis), how many instances counted in it, the
-- fleet's count of the previous window, the milliseconds left of the key's
-- ban (0: none), the units leased to the instance, its spare share (none
-- when it asked for nothing: it gives its lease back), and what the other
-- instances' live leases hold (spend share).
local now, inst, ends, share = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1'
local fleet, rank, learning = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] == '1'

-- spare returns the instance's spare share of free units: half of them
-- divided among the fleet (the first by id take one more unit each of
-- what does not divide evenly). Half even for an instance alone, which
-- may not know yet of instances that just joined, and holds its lease
-- and spare share from them until they lapse.
local function spare(free)
	free = math.max(free, 0)
	local half = math.floor((free + 1) / 2)
	local s = math.floor(half / fleet)
	if rank < half % fleet then
		s = s + 1
	end
	return s
end

-- num returns the integer key k holds, 0 when none.
local function num(k)
	local v = redis.pcall('GET', k)
	if type(v) == 'string' then
		return tonumber(v) or 0
	end
	return 0
end

-- others returns the other instances' counts in hash hk, summed, what
-- their live leases hold, summed, how many they are, and whether hk holds
-- this instance's field; a key under hk that is not a hash (a hand-made
-- SET) goes.
local function others(hk)
	local all = redis.pcall('HGETALL', hk)
	if all.err then
		redis.call('DEL', hk)
		return 0, 0, 0, false
	end
	local total, held, n, own = 0, 0, 0, false
	for j = 1, #all, 2 do
		if all[j] == inst then
			own = true
		else
			local count, lease, lapses = string.match(all[j + 1], '^(%-?%d+)/?(%d*)/?(%d*)$')
			total = total + (tonumber(count) or 0)
			if (tonumber(lapses) or 0) > now then
				held = held + (tonumber(lease) or 0)
			end
			n = n + 1
		end
	end
	return total, held, n, own
end

-- put writes the instance's field of hash hk and the fleet's count into
-- ck, both expiring at exp (the hash keeps the expiry it has).
local function put(ck, hk, count, field, exp)
	if redis.call('HSET', hk, inst, field) == 1 then
		redis.call('PEXPIREAT', hk, exp)
	end
	redis.call('SET', ck, count, 'PXAT', exp)
end

local out, nums = {}, cjson.decode(ARGV[8])
if #nums ~= 12 * #KEYS then
	return redis.error_reply('ERR sync: ' .. #nums .. ' numbers for ' .. #KEYS .. ' keys, want 12 each')
end
for i = 1, #KEYS do
	local c = KEYS[i]
	-- The other keys' names are built when a key needs them: most rounds
	-- of a fixed window need only h.
	local base = string.sub(c, 1, -2)
	local h = base .. 'h'
	local j = 12 * (i - 1)
	local e, w, mine, prev, refused, bans = nums[j + 1], nums[j + 2], nums[j + 3], nums[j + 4], nums[j + 5], nums[j + 6] == 1
	local max, want, pace, known, waiting, weighs = nums[j + 7], nums[j + 8], nums[j + 9], nums[j + 10] == 1, nums[j + 11] == 1, nums[j + 12]
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
		redis.call('DEL', c, base .. 'p', h, base .. 'q')
		ttl = -2
	else
		at = math.floor((now + ttl - w - e) / w + 0.5)
		if at == -1 then
			-- The count becomes the previous count, and expires as it
			-- should, when the instance's window ends.
			redis.call('RENAME', c, base .. 'p')
			if redis.call('EXISTS', h) == 1 then
				redis.call('RENAME', h, base .. 'q')
			else
				redis.call('DEL', base .. 'q')
			end
			at, ttl = 0, -2
		elseif at < -1 then
			redis.call('DEL', c, base .. 'p', h, base .. 'q') -- an older window
			at, ttl = 0, -2
		end
	end
	local total, n, ptotal, lease, extra, held = -1, 0, 0, 0, 0, 0
	if at == 0 then
		-- The others' counts and live leases: none in a new window.
		local counted, own = 0, false
		if ttl ~= -2 then
			counted, held, n, own = others(h)
		end
		total, n = counted + mine, n + 1
		if share then
			local learns = learning or (known and not own)
			-- What neither the counts nor the others' leases hold (this
			-- instance's own lease is renewed or given back), nor the
			-- first spare shares of instances not counted yet.
			local left = max - math.max(weighs, 0)
			local free = left - total - held
			if waiting and fleet > n then
				free = free - (fleet - n) * math.ceil(math.floor((math.max(left, 0) + 1) / 2) / fleet)
			end
			if learns then
				want = math.min(want, pace)
			end
			lease = math.max(math.min(want, free), 0)
			-- While learning, the spare share is held here for the
			-- others to see, and the instance takes no more of it than
			-- the figures it knows leave (redis_sync_round.go).
			if want > 0 and (learning or not learns) then
				extra = spare(free - lease)
			end
		end
		put(c, h, total, mine .. '/' .. (lease + extra) .. '/' .. ends, e + w)
		if prev >= 0 and e > now then
			local p, q = base .. 'p', base .. 'q'
			ptotal = others(q) + prev
			put(p, q, ptotal, prev, e)
		elseif weighs >= 0 then
			ptotal = num(base .. 'p')
		end
	elseif at == 1 then
		-- Redis counts the next window already: the instance's is the
		-- previous one (a count for the one before that is dropped).
		local p, q = base .. 'p', base .. 'q'
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
	if bans then
		ban = math.max(redis.call('PTTL', base .. 'b'), 0)
	end
	local o = #out
	out[o + 1], out[o + 2], out[o + 3], out[o + 4], out[o + 5], out[o + 6], out[o + 7] = total, n, ptotal, ban, lease, extra, held
end
return out
