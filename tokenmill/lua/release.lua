-- release: give a running job back after a retryable error (or a shutdown), keeping its work.
-- Pre:  the job is `running` under ARGV token.
-- Post: the job is `queued` (counts move running -> queued) with the error recorded; with a
--       checkpoint, the partial replaces the previous one; the message is republished now, or
--       after delay ms through the delayed set. When ARGV burn is 1 the retry counter grows,
--       and past max attempts the job ends `failed` with the error's class instead. A job
--       marked by `cancel` ends `cancelled` instead (counts move running -> cancelled), with its
--       checkpoint. The run's last activity time is now.
-- KEYS: 1 job, 2 counts, 3 leases, 4 delayed, 5 broker, 6 failures, 7 failure_last, 8 stats.
-- ARGV: 1 job id, 2 token, 3 error class, 4 message, 5 delay ms, 6 message to publish,
--       7 burn (0|1), 8 max attempts, 9 has checkpoint, 10 content, 11 reasoning, 12 tokens,
--       13 the original prompt's tokens.
-- Returns 'queued', 'delayed', 'failed', 'cancelled', 'done' (already done) or 'stale'.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'partition', 'cancel')
if f[1] == 'done' or f[1] == 'failed' then return f[1] end
if f[1] ~= 'running' or f[2] ~= ARGV[2] then return 'stale' end
local p = f[3]
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[1], 'lease', 'worker')
if ARGV[9] == '1' then
  redis.call('HSET', KEYS[1], 'ckpt_content', ARGV[10], 'ckpt_reasoning', ARGV[11],
    'ckpt_tokens', ARGV[12], 'ckpt_prompt', ARGV[13])
end
bump(KEYS[2], 'running|' .. p, -1, 0)
local now_ms = clock_ms()
redis.call('HSET', KEYS[8], 'last_activity_ms', now_ms)
if f[4] then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'cancelled_ms', now_ms, 'last_error_class',
    ARGV[3], 'last_error', ARGV[4])
  bump(KEYS[2], 'cancelled|' .. p, 1, 0)
  return 'cancelled'
end
if ARGV[7] == '1' then
  local retries = bump(KEYS[1], 'retries', 1, 0)
  if retries >= int(ARGV[8], 1, 1) then
    local msg = 'gave up after ' .. retries .. ' attempts: ' .. ARGV[4]
    redis.call('HSET', KEYS[1], 'state', 'failed', 'error_class', ARGV[3], 'error', msg)
    bump(KEYS[2], 'failed|' .. p, 1, 0)
    bump(KEYS[6], ARGV[3], 1, 0)
    redis.call('HSET', KEYS[7], ARGV[3], msg)
    return 'failed'
  end
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'last_error_class', ARGV[3], 'last_error', ARGV[4])
bump(KEYS[2], 'queued|' .. p, 1, 0)
local delay = int(ARGV[5], 0, 0)
if delay > 0 then
  redis.call('ZADD', KEYS[4], now_ms + delay, ARGV[1])
  return 'delayed'
end
redis.call('RPUSH', KEYS[5], ARGV[6])  -- the front: it keeps its checkpoint
return 'queued'
