-- One decision over one or more limits, atomically. The handler's verdict
-- rules are the memory store's: the request is admitted when every limit
-- admits it, and then each limit spends the request's cost; otherwise no
-- limit spends anything, and each limit that refuses tallies a refusal in a
-- key that expires with its window (and bans the key, if it bans). A
-- limit's keys carry one hash tag, so they share a Cluster slot (the store
-- sends only keys of one slot).
--
-- For check i, its keys from the cursor k (k = 1 for the first check):
--   KEYS[k]    count key (for GCRA: the theoretical arrival time, in
--              microseconds of Redis time)
--   KEYS[k+1]  refused key   KEYS[k+2]  previous count key
--   KEYS[k+3]  ban key       KEYS[k+4]  strikes key      (only when it bans)
--   then       leases key: the requests in flight, a sorted set of lease
--              ids scored with the Redis time (ms) at which each lapses
--              unless renewed                   (only with a max_in_flight)
-- and its arguments, ARGV[8i-7] to ARGV[8i]:
--   max; window in milliseconds;
--   cutoff: milliseconds from now at which a fixed window begun under a
--     longer window (a reload shortened it) ends at the latest; at or below
--     0 it has ended;
--   mode: 0 fixed window, 1 sliding-window counter, 2 GCRA, 3 sliding-window
--     counter on the calendar (window: the length of the calendar window
--     after the one in progress; cutoff: the milliseconds left of the one
--     in progress; burst: its length);
--   cost: the units the request spends;
--   burst: for GCRA, the bucket's size;
--   ban: "" when the limit does not ban, else "<ban ms>:<longest ban
--     ms>:<no ban>" (the longest above the ban: each violation within a
--     day of the previous ban's end doubles the ban; no ban 1: a refusal
--     of this request starts none, since requests in flight hold units).
--     A violation is a refusal by the count of a request of one unit;
--   in flight: "" without a max_in_flight, else "<max>:<lease ms>:<lease
--     id>": the request is refused when the key holds max live leases, and
--     takes the lease when admitted.
-- Returns, for check i, 8 values from 8i-7: whether the count admits the
-- request (1|0; a ban refuses it all the same), count (for GCRA the units in
-- the bucket), milliseconds to the end of the window (for GCRA until the
-- bucket is full), refused, previous window's count, milliseconds to wait
-- when the count refuses (0: the caller works it out from the rest), and
-- the milliseconds left of the key's ban (0: not banned; -1: a violation
-- that no ban 1 kept from starting one), and the key's requests in flight
-- after the decision (-1: they fill its max_in_flight, which refused the
-- request; 0 without one).
--
-- A fixed window is its count key, expiring when the window ends. A sliding
-- window's count key expires a window after its window ends, so that it can
-- serve as the previous count: while its time to live is over a window it
-- counts the window in progress (and the previous count key, expiring with
-- that window, holds the one before); once under, its window has ended and
-- the window in progress began at that end.
local now_us
local function clock()
	if not now_us then
		-- Redis 3.2 to 4 replicate scripts verbatim and refuse a write
		-- after TIME unless told to replicate effects (the default since
		-- 5, where this is a no-op).
		if redis.replicate_commands then
			redis.replicate_commands()
		end
		local t = redis.call('TIME')
		now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
	end
	return now_us
end

-- A key that holds no integer (to Redis: a word, a fraction, a leading
-- zero, out of int64's range), or is no string, was not written by these
-- scripts: a hand-made SET, another program's key under the prefix. Failing
-- on it would fail every decision on that client's key and, three failures
-- on, degrade the whole store: the limit starts afresh instead, as if the
-- key were not there (redis_fixed.lua does the same).

-- number returns the integer key k holds, nil when there is no key, and
-- false when the key is damaged.
local function number(k)
	local v = redis.pcall('GET', k)
	if not v then
		return nil
	end
	if type(v) == 'string' and (v == '0' or string.find(v, '^%-?[1-9]%d*$')) then
		local x = tonumber(v)
		if math.abs(x) < 9.2e18 then
			return x
		end
	end
	return false
end

-- tally adds one to the tally at key k, or starts a damaged one again at 1.
local function tally(k)
	local t = redis.pcall('INCR', k)
	if type(t) ~= 'table' then
		return t
	end
	if t.err and (string.sub(t.err, 1, 9) == 'WRONGTYPE' or string.find(t.err, 'not an integer', 1, true) or string.find(t.err, 'overflow', 1, true)) then
		redis.call('SET', k, 1)
		return 1
	end
	error(t) -- out of memory, read-only, ...: the decision fails
end

local n = #ARGV / 8
local checks = {}
local admit = true
local k = 1
for i = 1, n do
	local a = 8 * i - 8
	local ch = {
		c = KEYS[k], r = KEYS[k + 1], p = KEYS[k + 2],
		-- The cutoff and the burst stay strings until they are needed:
		-- each conversion costs Redis a strtod (redis_fixed.lua).
		max = tonumber(ARGV[a + 1]), window = tonumber(ARGV[a + 2]),
		mode = ARGV[a + 4], cost = tonumber(ARGV[a + 5]),
		prev = 0, count = 0, retry = 0, banned = 0,
	}
	k = k + 3
	if ARGV[a + 7] ~= '' then
		local ban, banmax, noban = string.match(ARGV[a + 7], '^(%d+):(%d+):([01])$')
		ch.ban, ch.banmax, ch.noban = tonumber(ban), tonumber(banmax), noban == '1'
		ch.b, ch.s = KEYS[k], KEYS[k + 1]
		k = k + 2
	end
	if ARGV[a + 8] ~= '' then
		-- Requests in flight: lapsed leases go (their instance died or
		-- lost them), then the live ones are counted.
		local cap, ttl, id = string.match(ARGV[a + 8], '^(%d+):(%d+):(.+)$')
		ch.f, ch.cap, ch.fttl, ch.fid = KEYS[k], tonumber(cap), tonumber(ttl), id
		k = k + 1
		ch.nowms = math.floor(clock() / 1000)
		redis.call('ZREMRANGEBYSCORE', ch.f, '-inf', ch.nowms)
		ch.flying = redis.call('ZCARD', ch.f)
		if ch.flying >= ch.cap then
			ch.flyfull = true
			admit = false
		end
	end
	local c = ch.c
	local ok
	if ch.mode == '2' then
		ch.burst = tonumber(ARGV[a + 6])
		local now = clock()
		ch.interval = ch.window * 1000 / ch.max
		local tat = number(c)
		if tat == false then
			redis.call('DEL', c, ch.r)
		end
		ch.tat = math.max(tat or 0, now)
		local after = ch.tat + ch.cost * ch.interval
		ok = ch.cost <= ch.burst and after - now <= ch.burst * ch.interval + 0.5
		ch.full = ch.tat + ch.interval - now > ch.burst * ch.interval + 0.5
		ch.state = 'gcra'
		if not ok then
			ch.retry = math.max(math.ceil((after - now - ch.burst * ch.interval) / 1000), 1)
		end
	elseif ch.mode == '1' or ch.mode == '3' then
		-- The window in progress: its length, and what is left of it
		-- (for a calendar window, from the calendar; else from the key).
		local cal = ch.mode == '3'
		local len, cur = ch.window, 0
		if cal then
			len, cur = tonumber(ARGV[a + 6]), tonumber(ARGV[a + 3])
		end
		local ttl = redis.call('PTTL', c)
		local v = number(c)
		if v == false or (ttl > 0 and v > 2e9) then
			-- Damaged, or a GCRA arrival time, left by a config that
			-- changed the algorithm: no count is that high (max and cost
			-- are at most 1e9). The window starts afresh.
			redis.call('DEL', c, ch.r, ch.p)
			ttl = -2
		end
		-- A calendar key of the window in progress expires the next
		-- window after it ends; one of the window before, when this one
		-- ends (half a window tells them apart, whatever the clocks).
		if (not cal and ttl > ch.window) or (cal and ttl > cur + ch.window / 2) then
			ch.state = 'current'
			-- At most a window: a reload that shortened the window leaves
			-- a longer time to live, which must not weigh the previous
			-- count above one.
			ch.left = math.min(ttl - ch.window, ch.window)
			if cal then
				ch.left = cur
			end
			ch.count = v
			local prev = number(ch.p)
			if prev == false then
				redis.call('DEL', ch.p)
			end
			ch.prev = prev or 0
		elseif ttl > 0 then
			ch.state = 'roll'
			ch.left = ttl
			if cal then
				ch.left = cur
			end
			ch.prev = v
		else
			ch.state = 'new'
			ch.left = ch.window
			if cal then
				ch.left = cur
			end
		end
		ok = ch.prev * ch.left / len + ch.count + ch.cost <= ch.max
		ch.full = ch.prev * ch.left / len + ch.count + 1 > ch.max
	else
		local ttl = redis.call('PTTL', c)
		local v = number(c)
		if v == false or (ttl > 0 and v > 2e9) then
			redis.call('DEL', c, ch.r) -- damaged or a GCRA arrival time, as above
			ttl, v = -2, nil
		end
		if ttl > ch.window + 100 then -- as in redis_fixed.lua
			local cutoff = tonumber(ARGV[a + 3])
			if cutoff <= 0 then
				redis.call('DEL', c, ch.r)
				ttl, v = -2, nil
			elseif cutoff < ttl then
				redis.call('PEXPIRE', c, cutoff)
				redis.call('PEXPIRE', ch.r, cutoff)
				ttl = cutoff
			end
		end
		-- ttl is -2 for a new window and -1 for a count key without an
		-- expiry (never written by this script): either way the window
		-- starts now, so no key outlives its window, and a refused tally
		-- left from an earlier window goes.
		if ttl < 0 then
			ch.state = 'new'
			ttl = ch.window
		else
			ch.state = 'current'
		end
		ch.left = ttl
		ch.count = v or 0
		ok = ch.count + ch.cost <= ch.max
		ch.full = ch.count + 1 > ch.max
	end
	ch.countok = ok
	if ch.b then
		local bttl = redis.call('PTTL', ch.b)
		if bttl > 0 then
			ok = false
			ch.banned = bttl
		end
	end
	ch.ok = ok
	if not ok then
		admit = false
	end
	checks[i] = ch
end
-- Past the cuts above, the first write is one that Redis refuses when out of
-- memory, so that an OOM Redis fails the decision instead of half-making it.
local out = {}
for i = 1, n do
	local ch = checks[i]
	local c, r, p = ch.c, ch.r, ch.p
	local state, ok, left = ch.state, ch.ok, ch.left
	local refused = 0
	if state == 'gcra' then
		local now = clock()
		if admit then
			ch.tat = ch.tat + ch.cost * ch.interval
			redis.call('SET', c, string.format('%.0f', ch.tat), 'PX', math.ceil((ch.tat - now) / 1000) + 1)
			redis.call('DEL', r)
		elseif not ok then
			refused = tally(r)
			redis.call('PEXPIRE', r, math.max(math.ceil((ch.tat - now) / 1000), ch.retry, ch.banned, 1))
		end
		left = math.ceil((ch.tat - now) / 1000)
		ch.count = math.ceil((ch.tat - now) / ch.interval - 1e-6)
	elseif (ch.mode == '1' or ch.mode == '3') and state ~= 'current' and (admit or not ok) then
		-- Sliding: start the window in progress; the previous count moves
		-- over.
		local start = 0
		if admit then
			start = ch.cost
		end
		redis.call('SET', c, start, 'PX', left + ch.window)
		if state == 'roll' then
			redis.call('SET', p, ch.prev, 'PX', left)
		else
			redis.call('DEL', p)
		end
		ch.count = start
		if not ok then
			redis.call('SET', r, 1, 'PX', left)
			refused = 1
		else
			redis.call('DEL', r)
		end
	elseif admit then
		ch.count = redis.call('INCRBY', c, ch.cost)
		if state == 'new' then
			redis.call('PEXPIRE', c, ch.window)
			redis.call('DEL', r)
		end
	elseif not ok then
		if state == 'new' then
			redis.call('PEXPIRE', c, ch.window)
			redis.call('SET', r, 1, 'PX', left)
			refused = 1
		else
			refused = tally(r)
			redis.call('PEXPIRE', r, math.max(left, ch.banned))
		end
	end
	if ch.b and ch.banned == 0 and ch.full and ch.noban then
		-- A violation the caller settles later (redis_ban.lua).
		ch.banned = -1
	elseif ch.b and ch.banned == 0 and ch.full then
		-- A violation: the key is banned from now.
		local strikes = 1
		local ban = ch.ban
		if ch.banmax > ch.ban then
			strikes = tally(ch.s)
		end
		while strikes > 1 and ban < ch.banmax do
			ban = ban * 2
			strikes = strikes - 1
		end
		if ch.banmax > ch.ban then
			ban = math.min(ban, ch.banmax)
			-- Violations are remembered for a day after the ban ends.
			redis.call('PEXPIRE', ch.s, ban + 86400000)
		end
		redis.call('SET', ch.b, 1, 'PX', ban)
		redis.call('PEXPIRE', r, math.max(left, ban))
		ch.banned = ban
	end
	local flying = 0
	if ch.flyfull then
		flying = -1
	elseif ch.f then
		flying = ch.flying
		if admit then
			redis.call('ZADD', ch.f, ch.nowms + ch.fttl, ch.fid)
			redis.call('PEXPIRE', ch.f, ch.fttl)
			flying = flying + 1
		end
	end
	local o = 8 * i - 8
	out[o + 1] = ch.countok and 1 or 0
	out[o + 2] = ch.count
	out[o + 3] = left
	out[o + 4] = refused
	out[o + 5] = ch.prev
	out[o + 6] = ch.retry
	out[o + 7] = ch.banned
	out[o + 8] = flying
end
return out
