-- Gives back one request's counts: the reservation a Cluster decision made
-- in one slot, when a limit in another slot refused the request. A count
-- never goes below zero, and a key that has expired meanwhile stays gone.
for i = 1, #KEYS do
	local n = tonumber(redis.call('GET', KEYS[i]) or '0')
	if n > 0 then
		redis.call('DECR', KEYS[i])
	end
end
return 0
