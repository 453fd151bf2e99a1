-- window_state: what admission's window rule (workers/admission/policy.py) reads of a server, at
-- one moment.
-- Pre:  nothing.  Post: nothing is written.
-- KEYS: 1 used hash, 2 slots zset (as admit.lua's).  ARGV: the used hash's fields to read.
-- Returns {now ms (Redis's clock: admit.lua stamps slots by it), the fields' values in ARGV's
-- order, {start ms, projected peak, ...} of each slot in flight}.
local now_ms = clock_ms()
local slots = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  local h = redis.call('HMGET', KEYS[1], 'at:' .. m, 'slot:' .. m)
  if h[1] and h[2] then slots[#slots + 1], slots[#slots + 2] = h[1], h[2] end
end
return {now_ms, redis.call('HMGET', KEYS[1], unpack(ARGV)), slots}
