-- WebSocket leases across instances: KEYS[1] is a client key's sorted set of
-- lease ids, each scored with the Redis time (ms) at which it expires unless
-- renewed. Expired leases are dropped before every count, so the leases of a
-- crashed instance lapse on their own; the set itself expires with its
-- longest-lived lease.
--
-- ARGV[1]  "acquire", "renew" or "release"
-- ARGV[2]  lease id
-- ARGV[3]  lease time to live in milliseconds
-- ARGV[4]  the most leases the key may hold (acquire)
-- Returns 1 when the lease is held (acquired or renewed) or released; 0
-- when acquire finds the key at its cap; 2 when renew found the lease gone
-- (lost with a failover or a restart) and took it again.
redis.replicate_commands() -- writes after TIME (a no-op from Redis 5 on)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key, op, id, ttl = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local result = 1
if op == 'release' then
	redis.call('ZREM', key, id)
else
	redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
	if op == 'renew' then
		-- A lease lost in Redis is taken again, over the cap if need be: a
		-- socket that lives must count.
		if not redis.call('ZSCORE', key, id) then
			result = 2
		end
	elseif redis.call('ZCARD', key) >= tonumber(ARGV[4]) then
		return 0
	end
	redis.call('ZADD', key, now + ttl, id)
end
local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
if last[2] then
	redis.call('PEXPIREAT', key, tonumber(last[2]))
end
return result
