-- retry: send failed (or cancelled) jobs back to `queued`, published within the broker bound.
-- Pre:  nothing; only a job in ARGV from-state moves (a failed one only if its class is allowed).
-- Post: such a job is `queued` with a fresh retry budget (`retries` 0; `attempts` keeps counting,
--       so request ids stay unique), its error moved to last_error_class/last_error, its cancel
--       mark gone and its checkpoint kept (it continues from it); counts move <from> -> queued.
--       A failed job's class leaves the failures hash (jobs failed now) and is counted in the
--       retried hash. Its message is on its queue's broker list, or its id on the queue's
--       backlog when the list already holds max depth messages (the feeder publishes it later).
-- KEYS: 1 counts, 2 failures, 3 retried, 4 stats, 5 broker short, 6 broker long, 7 backlog short,
--       8 backlog long, 9.. one job key per job.
-- ARGV: 1 from-state (failed | cancelled), 2 max depth, 3 allowed classes (comma-separated and
--       comma-wrapped, e.g. ',stall,auth,'; '' allows any), then 2 per job: id, message.
-- Returns one entry per job: '' (left alone), 'new:<class>' (published) or 'backlog:<class>'
-- (<class> is the failure class; 'cancelled' for a cancelled job).
local from, max_depth, allowed = ARGV[1], int(ARGV[2], 0, 0), ARGV[3]
local add, flush = publisher({KEYS[5], KEYS[6], KEYS[7], KEYS[8]}, max_depth)
local out = {}
local moved = 0
for i = 9, #KEYS do
  local job = KEYS[i]
  local a = 4 + (i - 9) * 2
  local f = redis.call('HMGET', job, 'state', 'partition', 'queue', 'error_class', 'error')
  local class = f[4] or 'unknown'
  if from == 'cancelled' then class = 'cancelled' end
  if f[1] ~= from or (from == 'failed' and allowed ~= '' and
      not string.find(allowed, ',' .. class .. ',', 1, true)) then
    out[#out + 1] = ''
  else
    local queue = f[3] or 'short'
    moved = moved + 1
    redis.call('HSET', job, 'state', 'queued', 'retries', 0)
    if from == 'failed' then
      redis.call('HSET', job, 'last_error_class', class, 'last_error', f[5] or '')
      redis.call('HDEL', job, 'error_class', 'error')
      if bump(KEYS[2], class, -1, 0) <= 0 then redis.call('HDEL', KEYS[2], class) end
      bump(KEYS[3], class, 1, 0)
    end
    redis.call('HDEL', job, 'cancel', 'cancelled_ms')
    move(KEYS[1], f[2], from, 'queued')
    out[#out + 1] = add(queue, ARGV[a], ARGV[a + 1]) .. ':' .. class
  end
end
flush()
if moved > 0 then
  redis.call('HSET', KEYS[4], 'last_activity_ms', clock_ms())
end
return out
