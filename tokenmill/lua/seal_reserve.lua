-- seal_reserve: record a shard's manifest, the done results it will hold, before any file is
-- written: the lowest-seq results of a partition's unsealed set.
-- Pre:  none. ARGV store is the sealer's result store.
-- Post: when the partition holds ARGV batch unsealed results, or the oldest has waited ARGV
--       after ms, or ARGV force is 1: up to `batch` of them left the unsealed set and are listed
--       in the new manifest (state `pending`, in the run's pending set); the run's store is
--       recorded if it was not; the partition's wait clock restarts for what is left (cleared
--       when nothing is). Otherwise only the wait clock starts (if it had not).
-- KEYS: 1 unsealed(partition), 2 seal_since, 3 manifest, 4 seals_pending, 5 results_store.
-- ARGV: 1 shard id, 2 partition, 3 batch, 4 after ms, 5 force (0|1), 6 store url.
-- Returns {'ok', job ids as a JSON array}, {'wait'}, {'empty'}, or {'store', recorded url} when
-- the run's shards live in another store (nothing changes).
-- Idempotent per shard id: a call whose manifest exists changes nothing and returns that
-- manifest's jobs while it is `pending` ({'wait'} once it is further along). The client sends a
-- call again after a connection error, and Redis may have run the first one before it died: a
-- second pop into the same manifest would overwrite the first's list, and those jobs would
-- leave the unsealed set for no shard (seen: a Redis SIGKILLed during a seal loop).
local kept = redis.call('HMGET', KEYS[3], 'state', 'jobs')
if kept[1] then
  if kept[1] == 'pending' and kept[2] then return {'ok', kept[2]} end
  return {'wait'}
end
local now_ms = clock_ms()
local store = redis.call('GET', KEYS[5])
if store and store ~= ARGV[6] then return {'store', store} end
local n = redis.call('ZCARD', KEYS[1])
if n == 0 then
  redis.call('HDEL', KEYS[2], ARGV[2])
  return {'empty'}
end
local since = tonumber(redis.call('HGET', KEYS[2], ARGV[2]) or '')
if not since or since ~= since then
  since = now_ms
  redis.call('HSET', KEYS[2], ARGV[2], now_ms)
end
local batch = int(ARGV[3], 1, 1)
if n < batch and now_ms - since < num(ARGV[4], 0, 0) and ARGV[5] ~= '1' then return {'wait'} end
local popped = redis.call('ZPOPMIN', KEYS[1], batch)
local ids = {}
for i = 1, #popped, 2 do ids[#ids + 1] = popped[i] end
local jobs = cjson.encode(ids)
if not store then redis.call('SET', KEYS[5], ARGV[6]) end
redis.call('HSET', KEYS[3], 'partition', ARGV[2], 'state', 'pending', 'n', #ids, 'jobs', jobs,
  'created_ms', now_ms)
redis.call('SADD', KEYS[4], ARGV[1])
if n > #ids then
  redis.call('HSET', KEYS[2], ARGV[2], now_ms)
else
  redis.call('HDEL', KEYS[2], ARGV[2])
end
return {'ok', jobs}
