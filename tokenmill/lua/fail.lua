-- fail: end a job with a terminal error. `failed` is final.
-- Pre:  the job is `running` under ARGV token.
-- Post: the job is `failed` with its error class and the server's message; the lease is gone;
--       counts move running -> failed; the run's failures-by-class count and latest message
--       for the class are updated; the run's last activity time is now.
-- KEYS: 1 job, 2 counts, 3 leases, 4 failures, 5 failure_last, 6 stats.
-- ARGV: 1 job id, 2 token, 3 error class, 4 message.
-- Returns 'ok', 'done'/'failed' (already final: nothing written) or 'stale'.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'partition')
if f[1] == 'done' or f[1] == 'failed' then return f[1] end
if f[1] ~= 'running' or f[2] ~= ARGV[2] then return 'stale' end
redis.call('HSET', KEYS[1], 'state', 'failed', 'error_class', ARGV[3], 'error', ARGV[4])
redis.call('HDEL', KEYS[1], 'lease', 'worker')
redis.call('ZREM', KEYS[3], ARGV[1])
move(KEYS[2], f[3], 'running', 'failed')
bump(KEYS[4], ARGV[3], 1, 0)
redis.call('HSET', KEYS[5], ARGV[3], ARGV[4])
redis.call('HSET', KEYS[6], 'last_activity_ms', clock_ms())
return 'ok'
