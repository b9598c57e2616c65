-- One batch of a sync round (store redis { sync }): for each key an
-- instance touched since its last round, it writes the instance's own count
-- of the window and reads back the fleet's. A key's counts of a window are
-- one hash, a field per instance, so a round sent twice (a reply lost to a
-- timeout) or again after Redis lost its data (a restart) writes the same
-- figures: nothing is counted twice, and nothing the instances still hold
-- is lost. The fleet's count is the fields' sum, read with them: a key
-- costs one read and one write a round. A refund (count_status) is a lower
-- count. The keys of one client share a hash tag, so a batch whose keys are
-- of one Cluster slot is one call.
--
-- Windows are aligned to the clock: every instance computes the same end
-- for the window in progress, and the hash holds its window's end (field
-- "="). The hash expires a window after its window ends: it then holds the
-- previous window's counts (renamed from g to o when the next window's
-- first count comes), which a sliding window weighs and which take the
-- late counts of instances that had not sent them when the window ended.
-- A count for a window older than that is never sent, and one for a
-- window Redis has already left behind is dropped (-1).
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
-- For key i, KEYS[i] is its hash of the window's counts (g); its other
-- keys end in another letter instead of g, under the same hash tag, so in
-- the same Cluster slot: o the counts of the window before, r the refused
-- tally, b the ban. ARGV[8]
-- holds every key's numbers, in the order of KEYS, in one binary argument
-- (unpacked, not parsed: appendNums in redis_sync_round.go), 73 bytes a key:
-- nine little-endian 64-bit integers and a byte of flags. The integers:
-- the end of the instance's window (Unix ms), the length of the window
-- after it (ms: a calendar's windows vary), the instance's count of it,
-- its count of the previous window (-1: not sent), refusals to add to the
-- tally, max, the units the instance asks to lease, the most it asks
-- while learning (twice what it spent since its last round: its pace,
-- not more), and the units the previous window weighs (-1: a fixed
-- window, whose previous count is not read). The flags: 1 to read the
-- ban, 2 when the instance wrote its count of the window before (if
-- Redis has it no more, Redis lost its state: the round leases as while
-- learning), 4 for the instance's first two rounds of the window.
-- Returns one binary string, 48 bytes a key in the order of KEYS (packed,
-- not formatted: readReplies in redis_sync_round.go): six little-endian
-- 64-bit integers, the fleet's count of the window (-1: dropped, the
-- window has ended in Redis), the fleet's count of the previous window,
-- the milliseconds left of the key's ban (0: none), the units leased to
-- the instance, its spare share (none when it asked for nothing: it gives
-- its lease back), and what the other instances' live leases hold (spend
-- share).
local now, inst, ends, share = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4] == '1' -- ends is only written: it stays a string
local fleet, rank, learning = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] == '1'

-- spare returns the instance's spare share of free units: half of them
-- divided among the fleet (the first by id take one more unit each of
-- what does not divide evenly). Half even for an instance alone, which
-- may not know yet of instances that just joined, and holds its lease
-- and spare share from them until they lapse.
local floor = math.floor
local function spare(free)
	if free < 0 then
		free = 0
	end
	local half = floor((free + 1) / 2)
	local s = floor(half / fleet)
	if rank < half % fleet then
		s = s + 1
	end
	return s
end

-- tally parses the fields of a hash of counts (HGETALL's reply): the
-- window end it holds (its "=" field, nil when none), the other instances'
-- counts, summed, what their live leases hold, summed, how many they are,
-- and whether it holds this instance's field. whole counts this
-- instance's field with the others' (a previous window, weighed whole).
local function tally(all, whole)
	local ge, total, held, n, seen = nil, 0, 0, 0, false
	for j = 1, #all, 2 do
		local f = all[j]
		if f == '=' then
			ge = tonumber(all[j + 1])
		elseif f == inst and not whole then
			seen = true
		else
			local count, lease, lapses = string.match(all[j + 1], '^(%-?%d+)/?(%d*)/?(%d*)$')
			total = total + (tonumber(count) or 0)
			if (tonumber(lapses) or 0) > now then
				held = held + (tonumber(lease) or 0)
			end
			n = n + 1
		end
	end
	return ge, total, held, n, seen
end

-- counts returns HGETALL of hash k; a key under k that is not a hash (a
-- hand-made SET) goes.
local function counts(k)
	local all = redis.pcall('HGETALL', k)
	if all.err then
		redis.call('DEL', k)
		return {}
	end
	return all
end

-- put writes the instance's field of hash k. A new hash (fresh) expires
-- at exp, a window after its window ends, and holds that end (ge) when
-- given; a hash keeps the expiry it has.
local function put(k, field, fresh, exp, ge)
	if fresh and ge then
		redis.call('HSET', k, '=', ge, inst, field)
	else
		redis.call('HSET', k, inst, field)
	end
	if fresh then
		redis.call('PEXPIREAT', k, exp)
	end
end

-- other returns the name of the key beside g (…g) that ends in letter,
-- built only when a key needs it: most rounds of a fixed window need g
-- alone.
local function other(g, letter)
	return string.sub(g, 1, -2) .. letter
end

-- unpack reads a key's numbers from ARGV[8] at pos: Redis's struct.unpack
-- with the layout above, or, where Lua has no struct library (miniredis,
-- which the fleet simulator runs this script on), the same read byte by
-- byte. Both return the nine integers, the flags and the next key's pos.
local layout = '<i8i8i8i8i8i8i8i8i8B'
local struct = rawget(_G, 'struct') -- nil without the library: no error
local unpack = struct and struct.unpack or function(_, s, pos)
	local v = {}
	for k = 1, 9 do
		local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(s, pos, pos + 7)
		if b8 >= 128 then
			b8 = b8 - 256 -- the sign
		end
		v[k] = b1 + 256 * (b2 + 256 * (b3 + 256 * (b4 + 256 * (b5 + 256 * (b6 + 256 * (b7 + 256 * b8))))))
		pos = pos + 8
	end
	return v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], string.byte(s, pos), pos + 1
end

-- pack writes a key's six replies as Redis's struct.pack does with the
-- reply's layout, or, without the library, byte by byte (a negative number
-- as its two's complement: the bytes of -v - 1, each inverted).
local replyLayout = '<i8i8i8i8i8i8'
local pack = struct and struct.pack or function(_, ...)
	local s = ''
	for k = 1, select('#', ...) do
		local v = select(k, ...)
		local neg = v < 0
		if neg then
			v = -v - 1
		end
		for _ = 1, 8 do
			local b = v % 256
			v = math.floor(v / 256)
			if neg then
				b = 255 - b
			end
			s = s .. string.char(b)
		end
	end
	return s
end

local out, nums, pos = {}, ARGV[8], 1
if #nums ~= 73 * #KEYS then
	return redis.error_reply('ERR sync: ' .. #nums .. ' bytes of numbers for ' .. #KEYS .. ' keys, want 73 each')
end
for i = 1, #KEYS do
	local g = KEYS[i]
	local e, w, mine, prev, refused, max, want, pace, weighs, flags
	e, w, mine, prev, refused, max, want, pace, weighs, flags, pos = unpack(layout, nums, pos)
	-- The flags' bits, read with arithmetic alone (miniredis's Lua has no
	-- bit library either), and inline: a function call per flag costs
	-- more than the rest of a key's arithmetic.
	local bans, known, waiting = flags % 2 == 1, flags % 4 >= 2, flags % 8 >= 4
	-- at is the window g counts, from the instance's: 0 the same (or none
	-- yet), -1 the one before, 1 the one after. g expires a window after
	-- its window ends.
	local all = counts(g)
	local ge, counted, held, n, own = tally(all, false)
	local at, fresh = 0, #all == 0
	if fresh then
		-- A new window (o, if any, is the previous window's: it expires
		-- when this one ends).
	elseif not ge or 2 * (ge + w - now) > 5 * w then
		-- Not this script's, or written under a longer window (a reload
		-- shortened it): the counts start afresh.
		redis.call('DEL', g, other(g, 'o'))
		fresh = true
	else
		at = floor((ge - e) / w + 0.5)
		if at == -1 then
			-- g becomes the previous window's, and expires as it should,
			-- when the instance's window ends.
			redis.call('RENAME', g, other(g, 'o'))
			at, fresh = 0, true
		elseif at < -1 then
			redis.call('DEL', g, other(g, 'o')) -- an older window
			at, fresh = 0, true
		end
	end
	if fresh then
		counted, held, n, own = 0, 0, 0, false
	end
	local total, ptotal, lease, extra = -1, 0, 0, 0
	if at == 0 then
		total, n = counted + mine, n + 1
		if share then
			local learns = learning or (known and not own)
			-- What neither the counts nor the others' leases hold (this
			-- instance's own lease is renewed or given back), nor the
			-- first spare shares of instances not counted yet.
			-- Comparisons, not math.max and math.min, on the path every
			-- key takes: each C call costs as much as the rest of this
			-- arithmetic (a key's first rounds may pay for a few).
			local left = max
			if weighs > 0 then
				left = max - weighs
			end
			local free = left - total - held
			if waiting and fleet > n then
				free = free - (fleet - n) * math.ceil(floor((math.max(left, 0) + 1) / 2) / fleet)
			end
			if learns and pace < want then
				want = pace
			end
			lease = want
			if free < lease then
				lease = free
			end
			if lease < 0 then
				lease = 0
			end
			-- While learning, the spare share is held here for the
			-- others to see, and the instance takes no more of it than
			-- the figures it knows leave (redis_sync_round.go).
			if want > 0 and (learning or not learns) then
				extra = spare(free - lease)
			end
		end
		-- Formatted as integers: concatenating the numbers would format
		-- each with %.14g, a float's conversion, which costs more.
		put(g, string.format('%d/%d/%s', mine, lease + extra, ends), fresh, e + w, e)
		if prev >= 0 and e > now then
			local o = other(g, 'o')
			local pall = counts(o)
			local _, others = tally(pall, false)
			ptotal = others + prev
			put(o, prev, #pall == 0, e)
		elseif weighs >= 0 then
			local _, whole = tally(counts(other(g, 'o')), true)
			ptotal = whole
		end
	elseif at == 1 then
		-- Redis counts the next window already: the instance's is the
		-- previous one (a count for the one before that is dropped).
		local o = other(g, 'o')
		local pall = counts(o)
		local _, others = tally(pall, false)
		total = others + mine
		put(o, mine, #pall == 0, e + w)
	end
	if total >= 0 and refused > 0 then
		local r = other(g, 'r')
		if type(redis.pcall('INCRBY', r, refused)) == 'table' then
			redis.call('SET', r, refused)
		end
		redis.call('PEXPIREAT', r, e)
	end
	local ban = 0
	if bans then
		ban = math.max(redis.call('PTTL', other(g, 'b')), 0)
	end
	out[i] = pack(replyLayout, total, ptotal, ban, lease, extra, held)
end
return table.concat(out)
