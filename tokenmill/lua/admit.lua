-- admit: take an admission slot on a server if its token budget (and the queue's cap) has room.
-- Pre:  nothing. Slots whose lease expired (a dead worker's) are dropped first.
-- Post: on success the slot holds ARGV tokens until released or expired; the used-tokens hash
--       (total and per queue) grows by them. With nothing admitted, one request is always let
--       in, so a request bigger than the budget cannot starve. The figures behind the decision
--       (budget, cap, tokens asked) are recorded in the used hash for status.
-- KEYS: 1 slots zset (member -> expiry ms), 2 used hash (total, <queue>, slot:<member> -> tokens
--       and queue), 3 unused.
-- ARGV: 1 member, 2 tokens, 3 queue, 4 budget, 5 queue cap, 6 ttl ms, 7 the other queue.
-- Returns 1 admitted, 0 no room.
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms)) do
  local held = redis.call('HMGET', KEYS[2], 'slot:' .. m, 'slotq:' .. m)
  if held[1] then
    redis.call('HINCRBY', KEYS[2], 'total', -tonumber(held[1]))
    redis.call('HINCRBY', KEYS[2], held[2], -tonumber(held[1]))
  end
  redis.call('HDEL', KEYS[2], 'slot:' .. m, 'slotq:' .. m)
  redis.call('ZREM', KEYS[1], m)
end
local member, tokens, queue = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local budget, cap = tonumber(ARGV[4]), tonumber(ARGV[5])
-- The queue cap binds only while the other queue is active (holding tokens, or refused
-- within the last 2 s): an idle queue's share is not wasted.
local other = ARGV[7]
local other_used = tonumber(redis.call('HGET', KEYS[2], other) or '0')
local other_wanted = tonumber(redis.call('HGET', KEYS[2], 'wanted:' .. other) or '0')
if other_used <= 0 and now_ms - other_wanted > 2000 then cap = budget end
redis.call('HSET', KEYS[2], 'budget', budget, 'cap:' .. queue, cap, 'asked:' .. queue, tokens)
if redis.call('ZSCORE', KEYS[1], member) then
  redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[6]), member)
  return 1
end
local total = tonumber(redis.call('HGET', KEYS[2], 'total') or '0')
local inq = tonumber(redis.call('HGET', KEYS[2], queue) or '0')
if total > 0 and (total + tokens > budget or inq + tokens > cap) then
  redis.call('HINCRBY', KEYS[2], 'refused', 1)
  redis.call('HSET', KEYS[2], 'wanted:' .. queue, now_ms)
  return 0
end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[6]), member)
redis.call('HSET', KEYS[2], 'slot:' .. member, tokens, 'slotq:' .. member, queue)
redis.call('HINCRBY', KEYS[2], 'total', tokens)
redis.call('HINCRBY', KEYS[2], queue, tokens)
redis.call('HINCRBY', KEYS[2], 'admitted', 1)
return 1
