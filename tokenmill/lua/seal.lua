-- seal: done -> sealed, for jobs whose rows are in a shard file already durable in the store.
-- Pre:  the shard's manifest is `pending` or `marking`; its file and spec file are in place and
--       hold a row for each job of KEYS 5...
-- Post: each of those jobs that is `done` is re-created holding only its state `sealed`, its
--       content hash and the shard id (prompt, result and attempt fields are gone; re-created,
--       because a hash never shrinks back to the compact encoding); it still counts as done, and
--       the partition's sealed count grows. A job in any other state is left alone. The manifest
--       is `marking`; with ARGV finish 1 it is `sealed` with its job list dropped, the shard is in
--       the partition's shard set and out of the pending set.
-- KEYS: 1 manifest, 2 seals_pending, 3 shards(partition), 4 sealed counts, 5.. job keys.
-- ARGV: 1 shard id, 2 partition, 3 finish (0|1), 4 rows in the shard, 5 shard bytes.
-- Returns the number of jobs sealed by this call, or -1 (nothing written) when the manifest is
-- missing or no longer being sealed.
local state = redis.call('HGET', KEYS[1], 'state')
if state ~= 'pending' and state ~= 'marking' then return -1 end
local n = 0
for i = 5, #KEYS do
  local f = redis.call('HMGET', KEYS[i], 'state', 'hash')
  if f[1] == 'done' then
    redis.call('DEL', KEYS[i])
    redis.call('HSET', KEYS[i], 'state', 'sealed', 'hash', f[2], 'shard', ARGV[1])
    n = n + 1
  end
end
if n > 0 then bump(KEYS[4], ARGV[2], n, 0) end
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[1], 'state', 'sealed', 'rows', ARGV[4], 'bytes', ARGV[5],
    'sealed_ms', clock_ms())
  redis.call('HDEL', KEYS[1], 'jobs')
  redis.call('SREM', KEYS[2], ARGV[1])
  redis.call('SADD', KEYS[3], ARGV[1])
else
  redis.call('HSET', KEYS[1], 'state', 'marking')
end
return n
