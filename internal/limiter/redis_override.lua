-- Sets one override of a zone: KEYS[1] is the zone's hash of overrides, a
-- field per client tag (the key, or its HMAC) holding the override as the
-- zone wrote it.
--
-- ARGV[1]  the client tag
-- ARGV[2]  the override
-- ARGV[3]  the most overrides the zone keeps
-- Returns 1 when set; 0 when the zone keeps ARGV[3] overrides already and
-- none of them is the tag's.
local key, tag = KEYS[1], ARGV[1]
if redis.call('HEXISTS', key, tag) == 0 and redis.call('HLEN', key) >= tonumber(ARGV[3]) then
	return 0
end
redis.call('HSET', key, tag, ARGV[2])
return 1
