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
-- A run's counts hash (`state|partition` -> jobs): `n` (default 1) of partition `p`'s jobs move
-- from state `from` to state `to`
local function move(counts, p, from, to, n)
  bumps(counts, 0, {from .. '|' .. p, -(n or 1), to .. '|' .. p, n or 1})
end
-- Admission (admit.lua, unadmit.lua): slot `m` given back: what it held leaves its server's used
-- hash `used`, and so do its fields; `held` is its fields slot:, slotq:, up:, tl: (HMGET order).
local function unhold(used, m, held)
  local tokens, moves = int(held[1], 0, 0, SLOT_MAX), {}
  if held[1] then moves = {'total', -tokens, 'n', -1} end
  if held[1] and held[2] then
    moves[5], moves[6], moves[7], moves[8] = held[2], -tokens, 'n:' .. held[2], -1
  end
  if held[3] then moves[#moves + 1], moves[#moves + 2] = 'unpaced', -1 end
  if held[4] then moves[#moves + 1], moves[#moves + 2] = 'tail', -1 end
  bumps(used, 0, moves)
  redis.call('HDEL', used, 'slot:' .. m, 'slotq:' .. m, 'at:' .. m, 'up:' .. m, 'tl:' .. m)
end
-- Publishing within the broker bound (enqueue.lua, retry.lua; `lists`: broker short, broker long,
-- backlog short, backlog long): `add(queue, id, message)` puts the message on its queue's broker
-- list while that holds fewer than `max_depth` messages ('new'), else the id on the queue's
-- backlog ('backlog'); `flush()` writes them. Messages (and backlogged ids) are pushed with one
-- call per queue: one redis.call per message cost about 9 us of Redis CPU each, half of the whole
-- enqueue. LPUSH of m1..mn leaves the order n single pushes leave, so workers still take them
-- first in, first out.
local function publisher(lists, max_depth)
  local depth = {short = redis.call('LLEN', lists[1]), long = redis.call('LLEN', lists[2])}
  local broker = {short = lists[1], long = lists[2]}
  local backlog = {short = lists[3], long = lists[4]}
  local messages = {short = {}, long = {}}
  local parked = {short = {}, long = {}}
  local function add(queue, id, message)
    if depth[queue] < max_depth then
      table.insert(messages[queue], message)
      depth[queue] = depth[queue] + 1
      return 'new'
    end
    table.insert(parked[queue], id)
    return 'backlog'
  end
  local function flush()
    for queue, pending in pairs(messages) do
      if #pending > 0 then redis.call('LPUSH', broker[queue], unpack(pending)) end
      if #parked[queue] > 0 then redis.call('RPUSH', backlog[queue], unpack(parked[queue])) end
    end
  end
  return add, flush
end
