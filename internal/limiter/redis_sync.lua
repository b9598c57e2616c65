-- One batch of a sync round (store redis { sync }): for each key an
-- instance touched since its last round, it writes the instance's own count
-- of the window and reads back the fleet's. A window's counts are one hash
-- per window (per Cluster slot on a Cluster), named by the window's end and
-- length, with a field per key (KEYS[i]) that holds a record per instance.
-- A round sent twice (a reply lost to a timeout) or again after Redis lost
-- its data (a restart) writes the same figures: nothing is counted twice,
-- and nothing the instances still hold is lost. The fleet's count is the
-- records' sum, read with them. A batch reads its keys' fields with one
-- HMGET per window and writes them with one HSET, whatever its size: the
-- cost per key is the script's arithmetic, not a command. A refund
-- (count_status) is a lower count.
--
-- Windows are aligned to the clock: every instance computes the same end
-- for the window in progress. A window's hash expires a window after the
-- window ends: it is then the previous window's, which a sliding window
-- weighs and which takes the late counts of instances that had not sent
-- them when the window ended. A count for a window older than that is
-- never sent, and one for a window the instance's clock has already left
-- behind is dropped (-1). Windows of another length (a reload) are other
-- hashes.
--
-- With spend share, an instance spends between two rounds what a round
-- leased it: the units it asked for (its recent demand) of what neither
-- the counts nor the other instances' live leases hold, and a spare share
-- of what is left after that (half of it divided among the instances that
-- synced recently). Its lease lapses at its end unless a round renews it:
-- capacity an instance stopped using is free again within the lease's
-- length, wherever the requests went. Its record is its id and three
-- little-endian 64-bit integers: count, leased (lease and spare share) and
-- until (Unix ms); a lapsed lease holds nothing. An instance not yet
-- counted in the window is taken to hold its first spare share (half of
-- what is left over the instances, see prior in redis_sync.go) until this
-- one's second round of the window, when every instance that touched the
-- key before its first has had a round.
--
--   ARGV[1] now in Unix milliseconds (the instance's clock); ARGV[2] the
--   instance's id (every instance's of one length); ARGV[3] the lease's
--   end (Unix ms); ARGV[4] 1 for spend share; ARGV[5] the instances that
--   synced recently; ARGV[6] this one's rank among them by id, from 0;
--   ARGV[7] 1 while learning (the lease no more than the pace); ARGV[8]
--   the keys' numbers (below); then, for each window hash the batch
--   touches, its name and when it expires (Unix ms).
-- KEYS[i] names key i: its field in the window hashes, and, with its last
-- letter (g) replaced, its other keys, under the same Cluster hash tag: r
-- the refused tally, b the ban. ARGV[8] holds every key's numbers, in the
-- order of KEYS, in one binary argument (unpacked, not parsed: appendNums
-- in redis_sync_round.go), 77 bytes a key: nine little-endian 64-bit
-- integers, a byte of flags and two little-endian 16-bit integers. The
-- 64-bit integers: the end of the instance's window (Unix ms), the length
-- of the window after it (ms: a calendar's windows vary), the instance's
-- count of it, its count of the previous window (-1: not sent), refusals
-- to add to the tally, max, the units the instance asks to lease, the
-- most it asks while learning (twice what it spent since its last round:
-- its pace, not more), and the units the previous window weighs (-1: a
-- fixed window, whose previous count is not read). The flags: 1 to read
-- the ban, 2 when the instance wrote its count of the window before (if
-- Redis has it no more, Redis lost its state: the round leases as while
-- learning), 4 for the instance's first two rounds of the window. The
-- 16-bit integers: the number of the window's hash among those ARGV names
-- (from 1), and of the previous window's (0: neither read nor written).
-- Returns one binary string, 48 bytes a key in the order of KEYS (packed,
-- not formatted: readReplies in redis_sync_round.go): six little-endian
-- 64-bit integers, the fleet's count of the window (-1: dropped), the
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

-- Redis's struct library reads and writes the binary layouts above; where
-- Lua has none (miniredis, which the fleet simulator runs this script on),
-- the same is done byte by byte: little-endian integers, a negative one as
-- its two's complement.
local struct = rawget(_G, 'struct') -- nil without the library: no error
local function int(s, pos, size, signed)
	local v = string.byte(s, pos + size - 1)
	if signed and v >= 128 then
		v = v - 256 -- the sign
	end
	for k = size - 2, 0, -1 do
		v = v * 256 + string.byte(s, pos + k)
	end
	return v
end
local layout, recordLayout, replyLayout = '<i8i8i8i8i8i8i8i8i8BHH', '<i8i8i8', '<i8i8i8i8i8i8'
local unpack = struct and struct.unpack or function(fmt, s, pos)
	if fmt == '<HH' then
		return int(s, pos, 2), int(s, pos + 2, 2), pos + 4
	elseif fmt == recordLayout then
		return int(s, pos, 8, true), int(s, pos + 8, 8, true), int(s, pos + 16, 8, true), pos + 24
	end
	local v = {}
	for k = 1, 9 do
		v[k] = int(s, pos + 8 * (k - 1), 8, true)
	end
	return v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9],
		string.byte(s, pos + 72), int(s, pos + 73, 2), int(s, pos + 75, 2), pos + 77
end
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
			v = floor(v / 256)
			if neg then
				b = 255 - b
			end
			s = s .. string.char(b)
		end
	end
	return s
end
local tableUnpack = rawget(_G, 'unpack') or table.unpack -- Lua's, which the record reader's name shadows

-- tally reads a field's records (nil: none): the other instances' counts,
-- summed, what their live leases hold, summed, how many they are, and
-- the other instances' records (to write back with this one's). whole
-- counts this instance's record with the others' (a previous window,
-- weighed whole).
local idLen = #inst
local recordLen = idLen + 24
local function tally(v, whole)
	if not v or #v % recordLen ~= 0 then
		return 0, 0, 0, '' -- none, or not the module's: the counts start afresh
	end
	if not whole and #v == recordLen and string.sub(v, 1, idLen) == inst then
		return 0, 0, 0, '' -- this instance's alone, the most common
	end
	local total, held, n, rest = 0, 0, 0, v
	for p = 1, #v, recordLen do
		if not whole and string.sub(v, p, p + idLen - 1) == inst then
			rest = string.sub(v, 1, p - 1) .. string.sub(v, p + recordLen)
		else
			local count, lease, lapses = unpack(recordLayout, v, p + idLen)
			total = total + count
			if lapses > now then
				held = held + lease
			end
			n = n + 1
		end
	end
	return total, held, n, rest
end

local nums, nkeys = ARGV[8], #KEYS
if #nums ~= 77 * nkeys then
	return redis.error_reply('ERR sync: ' .. #nums .. ' bytes of numbers for ' .. nkeys .. ' keys, want 77 each')
end
local hashes, nhashes = {}, (#ARGV - 8) / 2
for j = 1, nhashes do
	hashes[j] = ARGV[7 + 2 * j]
end

-- hmget returns the fields of window hash h; a key under h that is not a
-- hash (a hand-made SET) goes.
local function hmget(h, fields)
	local vals = redis.pcall('HMGET', h, tableUnpack(fields))
	if vals.err then
		redis.call('DEL', h)
		return {}
	end
	return vals
end

-- Each key's field of its window's hash, and of the previous window's
-- where it reads or writes that: one HMGET per hash.
local cur, prv = {}, {}
if nhashes == 1 then
	-- One window, and no previous one (the most common batch).
	cur = hmget(hashes[1], KEYS)
else
	local fields, owners = {}, {}
	for j = 1, nhashes do
		fields[j], owners[j] = {}, {}
	end
	for i = 1, nkeys do
		local h, ph = unpack('<HH', nums, 77 * i - 3) -- after the key's first 73 bytes
		if h < 1 or h > nhashes or ph > nhashes then
			return redis.error_reply('ERR sync: key ' .. i .. ' names window hashes ' .. h .. ' and ' .. ph .. ' of ' .. nhashes)
		end
		local f, o = fields[h], owners[h]
		f[#f + 1], o[#o + 1] = KEYS[i], i
		if ph > 0 then
			f, o = fields[ph], owners[ph]
			f[#f + 1], o[#o + 1] = KEYS[i], -i
		end
	end
	for j = 1, nhashes do
		if #fields[j] > 0 then
			local vals = hmget(hashes[j], fields[j])
			for k, i in ipairs(owners[j]) do
				if i > 0 then
					cur[i] = vals[k]
				else
					prv[-i] = vals[k]
				end
			end
		end
	end
end

local out, writes, pos = {}, {}, 1
for j = 1, nhashes do
	writes[j] = {}
end
local function put(j, field, v)
	local w = writes[j]
	w[#w + 1], w[#w + 2] = field, v
end
for i = 1, nkeys do
	local g = KEYS[i]
	local e, w, mine, prev, refused, max, want, pace, weighs, flags, h, ph
	e, w, mine, prev, refused, max, want, pace, weighs, flags, h, ph, pos = unpack(layout, nums, pos)
	-- The flags' bits, read with arithmetic alone (miniredis's Lua has no
	-- bit library either), and inline: a function call per flag costs
	-- more than the rest of a key's arithmetic.
	local bans, known, waiting = flags % 2 == 1, flags % 4 >= 2, flags % 8 >= 4
	local total, ptotal, lease, extra, held = -1, 0, 0, 0, 0
	if e + w > now then
		local v = cur[i]
		local counted, n, rest
		counted, held, n, rest = tally(v, false)
		local own = v and #rest < #v
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
		put(h, g, rest .. inst .. pack(recordLayout, mine, lease + extra, ends))
		if ph > 0 and prev >= 0 and e > now then
			local others, _, _, prest = tally(prv[i], false)
			ptotal = others + prev
			put(ph, g, prest .. inst .. pack(recordLayout, prev, 0, 0))
		elseif ph > 0 and weighs >= 0 then
			ptotal = tally(prv[i], true)
		end
		if refused > 0 then
			local r = string.sub(g, 1, -2) .. 'r'
			if type(redis.pcall('INCRBY', r, refused)) == 'table' then
				redis.call('SET', r, refused)
			end
			redis.call('PEXPIREAT', r, e)
		end
	end
	local ban = 0
	if bans then
		ban = math.max(redis.call('PTTL', string.sub(g, 1, -2) .. 'b'), 0)
	end
	out[i] = pack(replyLayout, total, ptotal, ban, lease, extra, held)
end
-- Each window's hash is written once, and expires a window after its
-- window ends (a hash of a window Redis's clock has left behind goes).
for j = 1, nhashes do
	if #writes[j] > 0 then
		redis.call('HSET', hashes[j], tableUnpack(writes[j]))
		redis.call('PEXPIREAT', hashes[j], ARGV[8 + 2 * j])
	end
end
return table.concat(out)
