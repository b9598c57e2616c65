-- WebSocket leases across instances: KEYS[1] is a client key's sorted set of
-- lease ids, each scored with the Redis time (ms) at which it expires unless
-- renewed. Expired leases are dropped before every count, so the leases of a
-- crashed instance lapse on their own.
--
-- ARGV[1]  "acquire", "renew" or "release"
-- ARGV[2]  lease id
-- ARGV[3]  lease time to live in milliseconds
-- ARGV[4]  the most leases the key may hold (acquire)
-- Returns 1 when the lease is held (acquired or renewed) or released, else 0.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local key, op, id, ttl = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
if op == 'release' then
	redis.call('ZREM', key, id)
	return 1
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
if op == 'renew' then
	if not redis.call('ZSCORE', key, id) then
		return 0
	end
elseif redis.call('ZCARD', key) >= tonumber(ARGV[4]) then
	return 0
end
redis.call('ZADD', key, now + ttl, id)
redis.call('PEXPIRE', key, ttl)
return 1
