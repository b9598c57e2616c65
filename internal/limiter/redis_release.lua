-- Gives back what admitted requests spent: the reservation a Cluster
-- decision made in one slot when a limit in another slot refused the
-- request, or a request whose response status does not count
-- (count_status). A count never goes below zero, and a key that has expired
-- meanwhile stays gone: the units went with its window.
--
-- For key i: ARGV[2i-1] the units to give back, 0 for a GCRA key;
-- ARGV[2i] 0 for a count key, or for a GCRA key (a theoretical arrival time
-- in microseconds of Redis time) the microseconds to take off it.
if redis.replicate_commands then
	redis.replicate_commands() -- a write after TIME, on Redis before 5
end
for i = 1, #KEYS do
	local c = KEYS[i]
	local cost, back = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
	local v = tonumber(redis.call('GET', c) or '0')
	if back > 0 and v > 0 then
		local t = redis.call('TIME')
		local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
		local tat = v - back
		if tat <= now + 1000 then -- within a millisecond: full (clocks are read apart)
			redis.call('DEL', c)
		else
			redis.call('SET', c, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1)
		end
	elseif cost > 0 and v > 0 then
		redis.call('DECRBY', c, math.min(cost, v))
	end
end
return 0
