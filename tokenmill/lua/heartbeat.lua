-- heartbeat: renew a lease and, optionally, checkpoint the partial generation.
-- Pre:  the job is `running` under ARGV token.
-- Post: the lease is extended by the ttl; with a checkpoint, the partial content, reasoning and
--       token count replace the previous checkpoint; ARGV new tokens are added to the run's
--       throughput bucket for this second. A stale token changes nothing.
--       With an admission slot (KEYS 4, ARGV 9) the slot's lease is extended too.
-- KEYS: 1 job, 2 leases, 3 throughput, [4 admission slots].
-- ARGV: 1 job id, 2 token, 3 ttl ms, 4 has checkpoint (0|1), 5 content, 6 reasoning,
--       7 checkpoint tokens, 8 new tokens since the last report, [9 admission slot member].
-- Returns 1, or 0 when the claim is stale.
local f = redis.call('HMGET', KEYS[1], 'state', 'token')
if f[1] ~= 'running' or f[2] ~= ARGV[2] then return 0 end
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
local expiry = now_ms + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'lease', expiry)
redis.call('ZADD', KEYS[2], expiry, ARGV[1])
if KEYS[4] then redis.call('ZADD', KEYS[4], 'XX', expiry, ARGV[9]) end
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'ckpt_content', ARGV[5], 'ckpt_reasoning', ARGV[6],
    'ckpt_tokens', ARGV[7])
end
local n = tonumber(ARGV[8])
if n > 0 then redis.call('HINCRBY', KEYS[3], t[1], n) end
return 1
