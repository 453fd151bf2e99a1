-- prelude: prepended to every script by tokenmill/transitions.py (not a transition of its own).
-- What a script reads (ARGV, and values stored in Redis, which anything may have written) is
-- clamped before it is used, so that no value makes a script error half-way through its
-- writes. A Lua number is a double: Redis refuses one past 2^53 or with a fraction (sent as
-- %.17g, e.g. 1.8446744073709552e+19) where it takes an integer (INCRBY, HINCRBY, HSET read
-- back as one), and a stored field may hold anything (`abc`, 2^63 - 1, which HINCRBY overflows).
local INT_MAX = 9007199254740991  -- 2^53 - 1: the largest integer a double holds exactly
-- The most tokens one admission slot holds (2^40, far past any KV pool), so that the sums of
-- slots stay exact (workers.admission.limiter.MAX_SLOT_TOKENS)
local SLOT_MAX = 1099511627776
-- `v` as a number within [lo, hi] (by default +-INT_MAX); `default` when it is absent, not a
-- number, or NaN
local function num(v, default, lo, hi)
  local x = tonumber(v)
  if x == nil or x ~= x then x = default end
  lo, hi = lo or -INT_MAX, hi or INT_MAX
  if x < lo then return lo elseif x > hi then return hi end
  return x
end
-- `num` rounded down to an integer
local floor = math.floor
local function int(v, default, lo, hi)
  return floor(num(v, default, lo, hi))
end
-- HINCRBY that cannot fail: a field that is not an integer, or that the move would take past
-- int64, is read as `int` reads it; the result is kept at `lo` or above (a count that drifted
-- below it heals) and within INT_MAX. Returns the new value.
local function bump(key, field, delta, lo)
  delta = int(delta, 0)
  local v = redis.pcall('HINCRBY', key, field, delta)
  if type(v) ~= 'number' then
    v = int(redis.call('HGET', key, field), 0, lo) + delta
  elseif v >= lo and v <= INT_MAX then
    return v  -- the usual case: one call, as HINCRBY alone
  end
  v = int(v, 0, lo)
  redis.call('HSET', key, field, v)
  return v
end
-- Redis's clock, in ms
local function clock_ms()
  local t = redis.call('TIME')
  return t[1] * 1000 + floor(t[2] / 1000)
end
-- `bump` of several fields of one hash: `moves` is {field, delta, field, delta, ...}
local function bumps(key, lo, moves)
  for i = 1, #moves, 2 do bump(key, moves[i], moves[i + 1], lo) end
end
-- Admission (admit.lua, unadmit.lua): what giving a slot back takes from its server's used hash,
-- as `bumps` moves; `held` is the slot's fields slot:, slotq:, up:, tl: (HMGET order).
local function unhold(held)
  local tokens, moves = int(held[1], 0, 0, SLOT_MAX), {}
  if held[1] then moves = {'total', -tokens, 'n', -1} end
  if held[1] and held[2] then
    moves[5], moves[6], moves[7], moves[8] = held[2], -tokens, 'n:' .. held[2], -1
  end
  if held[3] then moves[#moves + 1], moves[#moves + 2] = 'unpaced', -1 end
  if held[4] then moves[#moves + 1], moves[#moves + 2] = 'tail', -1 end
  return moves
end
