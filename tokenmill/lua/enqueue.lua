-- enqueue: create each job if absent and publish it, or report what the ledger already holds.
-- Pre:  nothing (any job may or may not exist).
-- Post: a new job is `queued`, counted in `queued|partition`, appended to the partition's list
--       (its `seq` field is its index in that list), and its message is on the broker list of
--       its queue, or its id on the queue's backlog when the broker list already holds max_depth
--       messages. An existing job is untouched. When any job is new, the run's first enqueue
--       time is set if absent and its last activity time is now.
-- KEYS: 1 runs, 2 partitions, 3 counts, 4 jobs(partition), 5 broker short, 6 broker long,
--       7 backlog short, 8 backlog long, 9 stats, 10.. one job key per job.
-- ARGV: 1 run, 2 partition, 3 max_depth, then 6 per job: id, hash, source, queue, spec, message.
-- Returns one entry per job: new | backlog | conflict:<source> | the state the job is in
--         (a conflict with a sealed job names its shard: it no longer keeps its source).
local run, partition, max_depth = ARGV[1], ARGV[2], int(ARGV[3], 0, 0)
local add, flush = publisher({KEYS[5], KEYS[6], KEYS[7], KEYS[8]}, max_depth)
local out = {}
local ids = {}
local seq0 = redis.call('LLEN', KEYS[4])
for i = 10, #KEYS do
  local a = 4 + (i - 10) * 6
  local job, hash, queue = KEYS[i], ARGV[a + 1], ARGV[a + 3]
  if redis.call('EXISTS', job) == 1 then
    local prior = redis.call('HMGET', job, 'state', 'hash', 'source', 'shard')
    if prior[2] ~= hash then
      out[#out + 1] = 'conflict:' .. (prior[3] or ('sealed shard ' .. tostring(prior[4])))
    else
      out[#out + 1] = prior[1]
    end
  else
    redis.call('HSET', job, 'state', 'queued', 'partition', partition, 'queue', queue,
      'hash', hash, 'source', ARGV[a + 2], 'spec', ARGV[a + 4], 'seq', seq0 + #ids)
    ids[#ids + 1] = ARGV[a]
    out[#out + 1] = add(queue, ARGV[a], ARGV[a + 5])
  end
end
flush()
if #ids > 0 then
  redis.call('RPUSH', KEYS[4], unpack(ids))
  redis.call('SADD', KEYS[1], run)
  redis.call('SADD', KEYS[2], partition)
  bump(KEYS[3], 'queued|' .. partition, #ids, 0)
  local now_ms = clock_ms()
  redis.call('HSETNX', KEYS[9], 'first_enqueue_ms', now_ms)
  redis.call('HSET', KEYS[9], 'last_activity_ms', now_ms)
end
return out
