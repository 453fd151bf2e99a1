-- admit: take an admission slot on a server if it has room, by the server's own figures when
-- they are fresh, else by a token budget.
-- Pre:  nothing. Slots whose lease expired (a dead worker's) are dropped first.
-- Post: on success the slot holds ARGV tokens until released or expired; the used hash counts one
--       more request in flight (`n`, `n:<queue>`) and ARGV tokens more (`total`, `<queue>`).
--       Room is decided by one of two rules:
--       * closed loop: while the server's window (`window`, set by the window rule from what the server
--         reports) was refreshed within ARGV 9 ms, at most `window` requests are in flight on it,
--         and a queue at most ARGV 8 (its share) of them while the other queue is active;
--       * guard (no fresh window: the first seconds of a run, a silent watcher): the tokens held
--         stay within the budget (ARGV 4), a queue's within its cap (ARGV 5).
--       * paced (closed loop only): while the pool binds (`bound`, set by policy.py) and the
--         requests' outputs are of one length (`len_dev` under an eighth of `len_mean`,
--         unadmit.lua; before any is known, their lifetimes: `life_dev`, `life_ms`), a
--         request starts every `life_ms` / window ms on average, in groups of ARGV 10: a group
--         opens when all its starts are due (GCRA: `pace_tat`), and for one pace after (from
--         `pace_open`) its starts go at once, so the server prefills them together; a paced
--         refusal counts in `paced`, not in `refused`, and says when the next group opens. A
--         slot admitted unpaced is marked (`up:<member>`) and counted in `unpaced` until
--         released.
--       * the tail (paced): when the run's requests still to start (ARGV 11, this one included;
--         start.lua counts them) could all start now without the pool overflowing at any moment
--         until they end (`fits_after`: each request in flight grows linearly from a young size
--         to its projected peak over a lifetime and then ends; the young size, `young_fit`, is
--         what made the requests in flight hold the KV use the server last reported, fitted by
--         policy.py), this one starts at once, past the pace and past the
--         window: nothing queued behind it would start together with it later, and started now
--         it ends sooner. If they would fit together only once some of those in flight end, but
--         sooner than pacing would start the last of them, this one waits for then (a paced
--         refusal that says when), and so does every paced start (another run's): paced to the
--         end, the pool drains for a whole lifetime after the last start. Such a slot is marked
--         (`tl:<member>`, counted in `tail`); while any is in flight, every other request
--         (another run's) must pass the same projection, since the window was sized for
--         requests spread over their lifetimes and these are not.
--       Either way, with nothing admitted one request is always let in, so a request bigger
--       than the budget cannot starve. The figures behind the decision are recorded for status.
-- KEYS: 1 slots zset (member -> expiry ms), 2 used hash (total, <queue>, n, n:<queue>,
--       slot:<member> -> tokens, slotq:<member> -> queue, at:<member> -> admitted ms, window,
--       window_ms, ...).
-- ARGV: 1 member, 2 tokens, 3 queue, 4 budget, 5 queue token cap, 6 ttl ms, 7 the other queue,
--       8 queue share (0-1], 9 window freshness ms, 10 pacing burst (requests; 0: not paced),
--       11 the run's requests still to start, this one included (absent or -1: unknown).
--       Every figure read (ARGV, the used hash, the slots' expiries) is clamped (prelude.lua):
--       garbage reads as 0 (or the field's default), a count never goes below 0, a lease more than
--       MAX_LEASE_MS ahead is expired, and once no slot is left the counts of requests in flight
--       are 0, so drift heals when the server drains.
-- Returns 1 admitted, 0 no room, -ms paced: no group opens for that many ms (at least 1).
local MAX_LEASE_MS = 86400000  -- a day: a slot's lease further ahead is garbage, not a lease
local now_ms = clock_ms()
for _, range in ipairs({{'-inf', now_ms}, {'(' .. (now_ms + MAX_LEASE_MS), '+inf'}}) do
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], range[1], range[2])) do
    local held = redis.call('HMGET', KEYS[2], 'slot:' .. m, 'slotq:' .. m, 'up:' .. m, 'tl:' .. m)
    unhold(KEYS[2], m, held)
    redis.call('ZREM', KEYS[1], m)
  end
end
if redis.call('ZCARD', KEYS[1]) == 0 then
  -- nothing in flight: whatever the counts of requests in flight say (drift, garbage) is 0
  local zero = {'total', 0, 'n', 0, 'unpaced', 0, 'tail', 0}
  for _, q in ipairs({ARGV[3], ARGV[7]}) do
    zero[#zero + 1], zero[#zero + 2], zero[#zero + 3], zero[#zero + 4] = q, 0, 'n:' .. q, 0
  end
  redis.call('HSET', KEYS[2], unpack(zero))
end
-- How soon (ms from now, 0: now) `count` requests of `peak` tokens each, started together, keep
-- the pool within `budget` at every moment until they end, if nothing else starts before them
-- (nil: not within `within` ms). Every request lives `life` ms and grows linearly from `young`
-- tokens (policy.py's `young_fit`: the size that makes the requests in flight hold what the
-- server last reported) to its projected peak (its slot's tokens). The pool is fullest just
-- before a request ends, or when the new ones peak: those moments are checked, for a start now
-- and for one just after each request in flight ends.
local function fits_after(count, peak, budget, life, young, within)
  -- when they peak, those in flight may have ended, but these hold their peaks: a test that
  -- spares the projection while much of the run is still queued
  if count * peak > budget or young < 0 then return nil end
  young = math.min(young, peak)
  local ages, peaks = {}, {}
  for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local h = redis.call('HMGET', KEYS[2], 'at:' .. m, 'slot:' .. m)
    if h[1] and h[2] then
      ages[#ages + 1], peaks[#peaks + 1] = now_ms - num(h[1], now_ms, 0, now_ms), num(h[2], 0, 0, SLOT_MAX)
    end
  end
  local function size(p, age)
    return young + math.max(0, p - young) * math.min(1, age / life)
  end
  local delays = {0}
  for i = 1, #ages do
    local ends = life - ages[i] + 1
    if ends > 0 and ends <= within then delays[#delays + 1] = ends end
  end
  table.sort(delays)
  for _, after in ipairs(delays) do
    local moments, fits = {life}, true
    for i = 1, #ages do moments[#moments + 1] = math.max(0, life - ages[i] - after) end
    for _, at in ipairs(moments) do
      local sum = count * size(peak, at)
      for i = 1, #ages do
        if life - ages[i] - after >= at then sum = sum + size(peaks[i], ages[i] + after + at) end
      end
      if sum > budget then fits = false break end
    end
    if fits then return after end
  end
  return nil
end
local member, tokens, queue = ARGV[1], int(ARGV[2], 0, 0, SLOT_MAX), ARGV[3]
local budget, cap, ttl = num(ARGV[4], 0, 0), num(ARGV[5], 0, 0), int(ARGV[6], 0, 0, MAX_LEASE_MS)
if redis.call('ZSCORE', KEYS[1], member) then
  redis.call('ZADD', KEYS[1], now_ms + ttl, member)
  return 1
end
-- A queue's share binds only while the other queue is active (holding requests, or refused
-- within the last 2 s): an idle queue's share is not wasted.
local other = ARGV[7]
local f = redis.call('HMGET', KEYS[2], 'total', queue, 'n', 'n:' .. queue, 'n:' .. other,
  'wanted:' .. other, 'window', 'window_ms', 'life_ms', 'life_dev', 'pace_tat', 'bound',
  'pace_open', 'tail', 'young_fit', 'len_mean', 'len_dev', 'admitted', 'unpaced', 'tailed')
local total, inq = int(f[1], 0, 0), int(f[2], 0, 0)
local n, nq, n_other = int(f[3], 0, 0), int(f[4], 0, 0), int(f[5], 0, 0)
local other_active = n_other > 0 or now_ms - num(f[6], 0, 0, now_ms) <= 2000
-- a stamp from the future would keep a window fresh for ever
local window, window_ms = int(f[7], 0, 0), num(f[8], 0, 0, now_ms)
local room
local pace, tat = 0, now_ms
local tail = false  -- this one starts with the rest of the run (the tail rule)
if window > 0 and now_ms - window_ms <= num(ARGV[9], 0, 0) then
  local qcap = other_active and math.max(1, math.floor(window * num(ARGV[8], 1, 0, 1))) or window
  room = n == 0 or (n < window and nq < qcap)
  redis.call('HSET', KEYS[2], 'rule', 'window', 'cap:' .. queue, qcap)
  -- paced while the pool binds (policy.py's `bound`) and requests live about as long as each
  -- other (those started together would end together, their successors start together again):
  -- a request every lifetime / window, in groups of ARGV 10
  local life, dev, group = num(f[9], 0, 0, MAX_LEASE_MS), num(f[10], 0, 0), int(ARGV[10], 0, 0)
  -- paced while outputs are of one length: their moving mean deviation under an eighth of their
  -- moving mean (until one is known, lifetimes; policy.py decides alike the same way)
  local len, len_dev = num(f[16], 0, 0), num(f[17], 0, 0)
  local alike = len > 0 and len_dev * 8 < len or len <= 0 and life > 0 and dev * 8 < life
  if group > 0 and f[12] == '1' and life > 0 and alike then
    pace = life / window
  end
  -- a due time no start could have set (beyond a lifetime and a group's paces) is garbage
  tat = math.max(now_ms, num(f[11], 0, 0, now_ms + life + group * pace))
  -- a group opens when all its starts are due (`pace_tat` reached); while it is open its starts
  -- go at once, as far as the group's credit goes
  local open = now_ms - num(f[13], -1e15, -1e15, now_ms) < pace and tat - (group - 1) * pace <= now_ms
  -- the pace holds this start back: no group is open and the next is not due
  local held_back = pace > 0 and n > 0 and tat > now_ms and not open
  local behind, young = num(ARGV[11], -1), num(f[15], -1)
  -- how soon the rest of the run fits together, while pacing would still start it (nil: not
  -- before then, or not asked). The projection holds each request to its projected peak, a
  -- bound because outputs are of one length
  local wait
  if pace > 0 and behind > 0 and not other_active and young >= 0 and n > 0 then
    wait = fits_after(behind, tokens, budget, life, young, (behind - group) * pace)
  end
  local tail_waits = wait ~= nil and wait > 0
  if wait == 0 and (not room or held_back) then
    -- the tail: the rest of the run fits now, started together; nothing behind it to pace for
    room, tail = true, true
  elseif tail_waits then
    -- the rest of the run fits together once some of those in flight end, before pacing would
    -- have started its last: it waits for then and ends sooner (paced to the end, the pool
    -- drains for a whole lifetime after the last start); no paced start (another run's) takes
    -- the room before then
    redis.call('HSET', KEYS[2], 'pace_tat', math.max(tat, now_ms + wait))
  elseif room and int(f[14], 0, 0) > 0 and n > 0 and life > 0 and young >= 0
    and fits_after(1, tokens, budget, life, young, 0) ~= 0 then
    -- a tail is in flight: what the window was sized for (spread stages) does not hold
    room = false
  end
  if tail_waits or (room and not tail and held_back) then
    -- paced: requests start spread over a lifetime, not together (their peaks would coincide);
    -- or the tail waits for its moment
    bump(KEYS[2], 'paced', 1, 0)
    redis.call('HSET', KEYS[2], 'wanted:' .. queue, now_ms)
    return -math.max(1, math.ceil(tail_waits and wait or tat - now_ms))
  end
  if room and not tail and pace > 0 and not open then  -- this start opens a group
    redis.call('HSET', KEYS[2], 'pace_open', now_ms)
  end
else
  if not other_active then cap = budget end
  room = total == 0 or (total + tokens <= budget and inq + tokens <= cap)
  redis.call('HSET', KEYS[2], 'rule', 'budget', 'budget', budget, 'cap:' .. queue, cap)
end
redis.call('HSET', KEYS[2], 'asked:' .. queue, tokens)
if not room then
  bump(KEYS[2], 'refused', 1, 0)
  redis.call('HSET', KEYS[2], 'wanted:' .. queue, now_ms)
  return 0
end
redis.call('ZADD', KEYS[1], now_ms + ttl, member)
-- the slot, and the counts it moves (read and clamped above), in one write
local w = {'slot:' .. member, tokens, 'slotq:' .. member, queue, 'at:' .. member, now_ms,
  'total', total + tokens, queue, inq + tokens, 'n', n + 1, 'n:' .. queue, nq + 1,
  'admitted', int(f[18], 0, 0) + 1}
local function also(...)
  for _, v in ipairs({...}) do w[#w + 1] = v end
end
if tail then  -- started together with the rest of the run
  also('up:' .. member, 1, 'tl:' .. member, 1, 'unpaced', int(f[19], 0, 0) + 1,
    'tail', int(f[14], 0, 0) + 1, 'tailed', int(f[20], 0, 0) + 1)
elseif pace > 0 then
  also('pace_tat', tat + pace)
else  -- started unpaced: it may have started together with others (policy.py counts them)
  also('up:' .. member, 1, 'unpaced', int(f[19], 0, 0) + 1)
end
redis.call('HSET', KEYS[2], unpack(w))
return 1
