-- unadmit: give an admission slot back.
-- Pre:  nothing (an unknown or expired slot is a no-op).
-- Post: the slot is gone; its tokens and its request are subtracted from the server's used
--       totals (`total`, `<queue>`, `n`, `n:<queue>`).
-- KEYS: 1 slots zset, 2 used hash.  ARGV: 1 member.
-- Returns 1 when a slot was released, else 0.
local held = redis.call('HMGET', KEYS[2], 'slot:' .. ARGV[1], 'slotq:' .. ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
if not held[1] then return 0 end
redis.call('HINCRBY', KEYS[2], 'total', -tonumber(held[1]))
redis.call('HINCRBY', KEYS[2], held[2], -tonumber(held[1]))
redis.call('HINCRBY', KEYS[2], 'n', -1)
redis.call('HINCRBY', KEYS[2], 'n:' .. held[2], -1)
redis.call('HDEL', KEYS[2], 'slot:' .. ARGV[1], 'slotq:' .. ARGV[1])
return 1
