-- cancel: stop jobs of a run: queued ones end `cancelled`, running ones are marked.
-- Pre:  nothing (only `queued` and `running` jobs are touched; done, failed and cancelled jobs
--       are left as they are).
-- Post: a `queued` job is `cancelled` (counts move queued -> cancelled) and out of the delayed
--       set; messages or backlog entries that still carry it are no-ops when they arrive. A
--       `running` job keeps its worker but carries `cancel` = ARGV mode (`now` is never lowered
--       to `after`): with `now` its next heartbeat tells the worker to stop; whenever it stops
--       without a result (a release, an expired lease) it ends `cancelled` with its checkpoint.
--       The run's last activity time is now when anything changed.
-- KEYS: 1 counts, 2 delayed, 3 stats, 4.. one job key per job.
-- ARGV: 1 mode (now | after), 2.. the job ids, in KEYS order.
-- Returns {queued jobs cancelled, running jobs marked}.
local now_ms = clock_ms()
local mode = ARGV[1]
local cancelled, marked = 0, 0
for i = 4, #KEYS do
  local job, id = KEYS[i], ARGV[i - 2]
  local f = redis.call('HMGET', job, 'state', 'partition', 'cancel')
  if f[1] == 'queued' then
    redis.call('HSET', job, 'state', 'cancelled', 'cancelled_ms', now_ms)
    redis.call('ZREM', KEYS[2], id)
    move(KEYS[1], f[2], 'queued', 'cancelled')
    cancelled = cancelled + 1
  elseif f[1] == 'running' then
    if f[3] ~= 'now' then redis.call('HSET', job, 'cancel', mode) end
    marked = marked + 1
  end
end
if cancelled + marked > 0 then redis.call('HSET', KEYS[3], 'last_activity_ms', now_ms) end
return {cancelled, marked}
