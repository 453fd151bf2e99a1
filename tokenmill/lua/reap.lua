-- reap: put a job whose lease expired back on its queue (its worker is presumed dead).
-- Pre:  the job is in the leases set.
-- Post: if it is `running` with an expired lease it is `queued` (counts move running ->
--       queued) and its message is at the consuming end of the broker list (it runs next);
--       its checkpoint stays for continuation. A job marked by `cancel` ends `cancelled`
--       instead (counts move running -> cancelled; nothing is published).
--       A job that is no longer running just leaves the leases set; a renewed lease is kept.
-- KEYS: 1 job, 2 counts, 3 leases, 4 broker.  ARGV: 1 job id, 2 message.
-- Returns 1 when the job was requeued, 2 when it ended cancelled, else 0.
local now_ms = clock_ms()
local f = redis.call('HMGET', KEYS[1], 'state', 'lease', 'partition', 'cancel')
if f[1] == 'running' and num(f[2], 0) > now_ms then return 0 end  -- a renewed lease is kept
redis.call('ZREM', KEYS[3], ARGV[1])
if f[1] ~= 'running' then return 0 end  -- no longer running: it just leaves the leases set
redis.call('HDEL', KEYS[1], 'lease', 'worker')
bump(KEYS[2], 'running|' .. f[3], -1, 0)
if f[4] then
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'cancelled_ms', now_ms)
  bump(KEYS[2], 'cancelled|' .. f[3], 1, 0)
  return 2
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'last_error_class', 'lease_expired',
  'last_error', 'the worker holding the lease stopped renewing it', 'reaped_ms', now_ms)
bump(KEYS[1], 'reaps', 1, 0)
bump(KEYS[2], 'queued|' .. f[3], 1, 0)
redis.call('RPUSH', KEYS[4], ARGV[2])  -- the front: it runs next
return 1
