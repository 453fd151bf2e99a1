-- heartbeat: renew a lease and, optionally, checkpoint the partial generation.
-- Pre:  the job is `running` under ARGV token.
-- Post: the lease is extended by the ttl; with a checkpoint, the partial content, reasoning,
--       token count and the original prompt's size replace the previous checkpoint; ARGV new tokens are added to the run's
--       throughput bucket for this second. A stale token changes nothing.
--       With an admission slot (KEYS 4-6, ARGV 10-) the slot's lease is extended too, the
--       tokens it holds are set to ARGV 11 (the request's current projection), and each length
--       bin it reached since the last report (ARGV 12...) counts one more request in the run's
--       lengths hash. Numbers read are clamped (prelude.lua); counts stay at 0 or above.
-- KEYS: 1 job, 2 leases, 3 throughput, [4 admission slots, 5 admission used, 6 run lengths].
-- ARGV: 1 job id, 2 token, 3 ttl ms, 4 has checkpoint (0|1), 5 content, 6 reasoning,
--       7 checkpoint tokens, 8 new tokens since the last report, 9 checkpoint prompt tokens,
--       [10 slot member, 11 slot tokens, 12... lengths fields reached (r<bin>)].
-- Returns 1, 2 when `cancel --now` marked the job (the worker stops it; the lease and the
-- checkpoint are still written), or 0 when the claim is stale.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'cancel')
if f[1] ~= 'running' or f[2] ~= ARGV[2] then return 0 end
local now_ms = clock_ms()
local expiry = now_ms + int(ARGV[3], 0, 0)
redis.call('HSET', KEYS[1], 'lease', expiry)
redis.call('ZADD', KEYS[2], expiry, ARGV[1])
if KEYS[4] then
  redis.call('ZADD', KEYS[4], 'XX', expiry, ARGV[10])
  local held = redis.call('HMGET', KEYS[5], 'slot:' .. ARGV[10], 'slotq:' .. ARGV[10])
  if held[1] and held[2] and ARGV[11] and ARGV[11] ~= '' then
    local tokens = int(ARGV[11], 0, 0, SLOT_MAX)
    local delta = tokens - int(held[1], 0, 0, SLOT_MAX)
    if delta ~= 0 then
      redis.call('HSET', KEYS[5], 'slot:' .. ARGV[10], tokens)
      bumps(KEYS[5], 0, {'total', delta, held[2], delta})
    end
  end
  for i = 12, #ARGV do bump(KEYS[6], ARGV[i], 1, 0) end
end
if ARGV[4] == '1' then
  redis.call('HSET', KEYS[1], 'ckpt_content', ARGV[5], 'ckpt_reasoning', ARGV[6],
    'ckpt_tokens', ARGV[7], 'ckpt_prompt', ARGV[9])
end
local n = int(ARGV[8], 0, 0)
if n > 0 then bump(KEYS[3], floor(now_ms / 1000), n, 0) end
if f[3] == 'now' then return 2 end
return 1
