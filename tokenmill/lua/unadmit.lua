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
  'tl:' .. ARGV[1], 'at:' .. ARGV[1], 'life_ms', 'life_dev', 'len_mean', 'len_dev', 'life_n', 'len_n')
redis.call('ZREM', KEYS[1], ARGV[1])
if not held[1] then return 0 end
-- a moving mean (a tenth of the way to each value, the plain mean of the first ten) and the
-- moving mean of the deviations from it, counted in `count_field` up to 11 (a mean stored without
-- a count is an old one: a tenth). A deviation is not known from one value: it reads as large as
-- the value itself (not of one length) until a second one. Weighted from 0 as a tenth, a few
-- values that differ would read as alike and pace outputs of many lengths.
local function moving(value, mean_field, dev_field, count_field, mean, dev, count)
  local k = 1
  if count then k = int(count, 0, 0, 10) + 1 elseif mean then k = 11 end
  mean, dev = num(mean, 0), num(dev, 0, 0)
  if k == 1 then
    mean, dev = value, value
  else
    dev = dev + (math.abs(value - mean) - dev) * math.max(0.1, 1 / (k - 1))
    mean = mean + (value - mean) * math.max(0.1, 1 / k)
  end
  redis.call('HSET', KEYS[2], mean_field, mean, dev_field, dev, count_field, k)
end
if held[5] then
  -- how long the request held its slot: the mean lifetime and its mean deviation pace starts
  -- (admit.lua)
  local now_ms = clock_ms()
  moving(now_ms - num(held[5], now_ms, 0, now_ms), 'life_ms', 'life_dev', 'life_n', held[6], held[7],
    held[10])
  -- how many tokens it generated: outputs of one length are what pacing is for (their lifetimes
  -- also agree, but a lifetime also moves with how full the server's batches are and how long a
  -- request waited in its queue)
  local out = num(ARGV[2], -1)
  if out >= 0 then moving(out, 'len_mean', 'len_dev', 'len_n', held[8], held[9], held[11]) end
end
unhold(KEYS[2], ARGV[1], held)
return 1
