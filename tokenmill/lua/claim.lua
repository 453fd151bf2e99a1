-- claim: take a job for one attempt, with a lease and a new fencing token.
-- Pre:  the job is `queued`, or `running` with an expired lease (its worker is presumed dead)
--       and not marked by `cancel` (the reaper ends such a job `cancelled`).
-- Post: the job is `running`, owned by ARGV worker until the lease expires; `token` (the fencing
--       token every later transition must present) and `attempts` are incremented; a pending
--       delayed retry is dropped. Counts move queued -> running (none move on a takeover).
--       While the run is paused (KEYS 5 exists) nothing is claimed: the job stays as it is.
-- KEYS: 1 job, 2 counts, 3 leases, 4 delayed, 5 the run's paused hash.
-- ARGV: 1 job id, 2 worker, 3 lease ttl ms.
-- Returns {'ok', token, attempts, spec, ckpt_content, ckpt_reasoning, ckpt_tokens, partition,
--          queue, retries, ckpt_prompt} or {reason}: missing | done | failed | cancelled | busy
--          (a sealed job is done), or {'paused', the pause's reason}.
local now_ms = clock_ms()
local f = redis.call('HMGET', KEYS[1], 'state', 'lease', 'partition', 'cancel')
local state, lease, partition = f[1], num(f[2], 0), f[3]
if not state then return {'missing'} end
if state == 'done' or state == 'failed' or state == 'cancelled' then return {state} end
if state == 'sealed' then return {'done'} end
if state == 'running' and lease > now_ms then return {'busy'} end
if state == 'running' and f[4] then return {'cancelled'} end
local paused = redis.call('HGET', KEYS[5], 'reason')
if paused then return {'paused', paused} end
if state == 'queued' then
  move(KEYS[2], partition, 'queued', 'running')
end
local token = bump(KEYS[1], 'token', 1, 0)
local attempts = bump(KEYS[1], 'attempts', 1, 0)
local expiry = now_ms + int(ARGV[3], 0, 0)
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[2], 'lease', expiry,
  'claimed_ms', now_ms)
redis.call('ZADD', KEYS[3], expiry, ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
local r = redis.call('HMGET', KEYS[1], 'spec', 'ckpt_content', 'ckpt_reasoning', 'ckpt_tokens',
  'queue', 'retries', 'ckpt_prompt')
return {'ok', token, attempts, r[1], r[2] or '', r[3] or '', int(r[4], 0, 0), partition, r[5],
  int(r[6], 0, 0), int(r[7], 0, 0)}
