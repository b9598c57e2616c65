-- wrk script: each request names a client, cycling through CLIENTS distinct
-- ids (env, default 100000), so a run of at least that many requests tracks
-- every one of them. With HEADER=X-Forwarded-For the id is sent as an IPv4
-- address (10.a.b.c) for Caddy to resolve through trusted_proxies; otherwise
-- it is sent as a number in X-Client. START (env) is where the ids begin:
-- a run goes on from the clients the runs before it sent.
local clients = tonumber(os.getenv("CLIENTS") or "100000")
local header = os.getenv("HEADER") or "X-Client"
local ipv4 = header == "X-Forwarded-For"
local n = tonumber(os.getenv("START") or "0")
request = function()
	n = n + 1
	local id = n % clients
	if ipv4 then
		wrk.headers[header] = string.format("10.%d.%d.%d", math.floor(id / 65536) % 256, math.floor(id / 256) % 256, id % 256)
	else
		wrk.headers[header] = tostring(id)
	end
	return wrk.format(nil)
end
