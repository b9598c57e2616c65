-- A violation that stands after the fact (the requests in flight when it
-- was refused settled counted): the key is banned from now, as redis.lua
-- bans at a refusal.
--   KEYS[1] ban key   KEYS[2] strikes key   KEYS[3] refused key
--   ARGV[1] ban in milliseconds   ARGV[2] longest ban in milliseconds
--     (above the ban: each violation within a day of the previous ban's
--     end doubles the ban)
-- Returns the ban in milliseconds.
local ban, banmax = tonumber(ARGV[1]), tonumber(ARGV[2])
local strikes = 1
if banmax > ban then
	local t = redis.pcall('INCR', KEYS[2])
	if type(t) == 'table' then
		-- A damaged tally starts again at 1 (redis.lua's tally).
		redis.call('SET', KEYS[2], 1)
		t = 1
	end
	strikes = t
end
local d = ban
while strikes > 1 and d < banmax do
	d = d * 2
	strikes = strikes - 1
end
if banmax > ban then
	d = math.min(d, banmax)
	-- Violations are remembered for a day after the ban ends.
	redis.call('PEXPIRE', KEYS[2], d + 86400000)
end
redis.call('SET', KEYS[1], 1, 'PX', d)
-- The refused tally is listed with the ban: it lives as long.
if redis.call('PTTL', KEYS[3]) < d then
	redis.call('PEXPIRE', KEYS[3], d)
end
return d
