-- wrk script: each request names a client in X-Client, cycling through
-- CLIENTS distinct ids (env, default 100000), so a run of at least that
-- many requests tracks every one of them.
local clients = tonumber(os.getenv("CLIENTS") or "100000")
local n = 0
request = function()
	n = n + 1
	wrk.headers["X-Client"] = tostring(n % clients)
	return wrk.format(nil)
end
