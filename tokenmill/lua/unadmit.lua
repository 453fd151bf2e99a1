-- unadmit: give an admission slot back.
-- Pre:  nothing (an unknown or expired slot is a no-op).
-- Post: the slot is gone; its tokens and its request are subtracted from the server's used
--       totals (`total`, `<queue>`, `n`, `n:<queue>`, `unpaced` if it started unpaced, `tail` if
--       it started with the run's tail); how
--       long it was held moves the moving mean lifetime (`life_ms`) and its mean deviation
--       (`life_dev`), which pace admissions (admit.lua), and the tokens the request generated
--       (ARGV 2, when given) move the moving mean output (`len_mean`) and its mean deviation
--       (`len_dev`), which say whether admissions are paced. An expired slot (admit.lua) does
--       not. What it reads is clamped (prelude.lua): garbage reads as 0, counts stay at 0 or above.
-- KEYS: 1 slots zset, 2 used hash.  ARGV: 1 member, 2 the tokens the request generated while it
--       held the slot (absent: not known, a slot given back without a result).
-- Returns 1 when a slot was released, else 0.
local held = redis.call('HMGET', KEYS[2], 'slot:' .. ARGV[1], 'slotq:' .. ARGV[1], 'up:' .. ARGV[1],
  'tl:' .. ARGV[1], 'at:' .. ARGV[1], 'life_ms', 'life_dev', 'len_mean', 'len_dev')
redis.call('ZREM', KEYS[1], ARGV[1])
if not held[1] then return 0 end
-- a moving mean (a tenth of the way to each value; the first taken whole) and the moving mean
-- of the deviations from it
local function moving(value, mean_field, dev_field, mean, dev)
  mean, dev = num(mean, -1), num(dev, 0, 0)
  if mean >= 0 then
    dev = dev + (math.abs(value - mean) - dev) * 0.1
    value = mean + (value - mean) * 0.1
  end
  redis.call('HSET', KEYS[2], mean_field, value, dev_field, dev)
end
if held[5] then
  -- how long the request held its slot: the mean lifetime and its mean deviation pace starts
  -- (admit.lua)
  local now_ms = clock_ms()
  moving(now_ms - num(held[5], now_ms, 0, now_ms), 'life_ms', 'life_dev', held[6], held[7])
  -- how many tokens it generated: outputs of one length are what pacing is for (their lifetimes
  -- also agree, but a lifetime also moves with how full the server's batches are and how long a
  -- request waited in its queue)
  local out = num(ARGV[2], -1)
  if out >= 0 then moving(out, 'len_mean', 'len_dev', held[8], held[9]) end
end
unhold(KEYS[2], ARGV[1], held)
return 1
