-- enqueue: create each job if absent and publish it, or report what the ledger already holds.
-- Pre:  nothing (any job may or may not exist).
-- Post: a new job is `queued`, counted in `queued|partition`, appended to the partition's list,
--       and its message is on the broker list of its queue, or its id on the queue's backlog when
--       the broker list already holds max_depth messages. An existing job is untouched.
-- KEYS: 1 runs, 2 partitions, 3 counts, 4 jobs(partition), 5 broker short, 6 broker long,
--       7 backlog short, 8 backlog long, 9.. one job key per job.
-- ARGV: 1 run, 2 partition, 3 max_depth, then 6 per job: id, hash, source, queue, spec, message.
-- Returns one entry per job: new | backlog | queued | running | done | failed | conflict:<source>
local run, partition, max_depth = ARGV[1], ARGV[2], tonumber(ARGV[3])
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
local out = {}
local created = 0
for i = 9, #KEYS do
  local a = 4 + (i - 9) * 6
  local id, hash, source, queue, spec, msg =
    ARGV[a], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3], ARGV[a + 4], ARGV[a + 5]
  local job = KEYS[i]
  local prior = redis.call('HMGET', job, 'state', 'hash', 'source')
  if prior[1] then
    if prior[2] ~= hash then
      out[#out + 1] = 'conflict:' .. prior[3]
    else
      out[#out + 1] = prior[1]
    end
  else
    redis.call('HSET', job, 'state', 'queued', 'partition', partition, 'queue', queue,
      'hash', hash, 'source', source, 'spec', spec, 'attempts', 0, 'token', 0, 'retries', 0,
      'enq_ms', now_ms)
    redis.call('RPUSH', KEYS[4], id)
    created = created + 1
    local broker, backlog = KEYS[5], KEYS[7]
    if queue == 'long' then broker, backlog = KEYS[6], KEYS[8] end
    if redis.call('LLEN', broker) < max_depth then
      redis.call('LPUSH', broker, msg)
      out[#out + 1] = 'new'
    else
      redis.call('RPUSH', backlog, id)
      out[#out + 1] = 'backlog'
    end
  end
end
if created > 0 then
  redis.call('SADD', KEYS[1], run)
  redis.call('SADD', KEYS[2], partition)
  redis.call('HINCRBY', KEYS[3], 'queued|' .. partition, created)
end
return out
