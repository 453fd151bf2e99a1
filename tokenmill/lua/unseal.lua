-- unseal: sealed -> queued, for the jobs of a lost shard (repair), from its spec file.
-- Pre:  the shard's file is missing or unreadable; ARGV carries each job's spec as the shard's
--       spec file kept it.
-- Post: each job of KEYS 5... that is `sealed` in ARGV shard is `queued` again as enqueue left
--       it (state, partition, queue, hash, source, spec, seq) plus `repaired`; counts move
--       done -> queued and the partition's sealed count drops. No message is published (the
--       caller republishes). With ARGV last 1, the manifest is `lost` and out of the partition's
--       shard set, so exports stop reading it.
-- KEYS: 1 counts, 2 sealed counts, 3 manifest, 4 shards(partition), 5.. job keys.
-- ARGV: 1 shard id, 2 partition, 3 last (0|1), then 5 per job: queue, hash, source, spec, seq.
-- Returns the number of jobs requeued by this call.
local n = 0
for i = 5, #KEYS do
  local a = 4 + (i - 5) * 5
  local f = redis.call('HMGET', KEYS[i], 'state', 'shard')
  if f[1] == 'sealed' and f[2] == ARGV[1] then
    redis.call('DEL', KEYS[i])
    redis.call('HSET', KEYS[i], 'state', 'queued', 'partition', ARGV[2], 'queue', ARGV[a],
      'hash', ARGV[a + 1], 'source', ARGV[a + 2], 'spec', ARGV[a + 3], 'seq', ARGV[a + 4],
      'repaired', ARGV[1])
    n = n + 1
  end
end
if n > 0 then
  move(KEYS[1], ARGV[2], 'done', 'queued', n)
  bump(KEYS[2], ARGV[2], -n, 0)
end
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[3], 'state', 'lost')
  redis.call('SREM', KEYS[4], ARGV[1])
end
return n
