-- adapt: steer a server's admission window by what the server itself reports (closed loop).
-- Pre:  ARGV are the server's figures just read (one watcher per server calls this, about
--       twice a second).
-- Post: `window` (requests tokenmill may have in flight on the server) is updated and stamped
--       `window_ms`; the figures are kept for status (`srv_running`, `srv_waiting`, `srv_used`,
--       `srv_cap`, `srv_retractions`), and so is the young size they show (`young_fit`, for
--       admit.lua's tail; see the end). The figures lag the server (SGLang 0.5.23 publishes them
--       every 15 decode steps), so every rule is safe to apply twice to the same figures. In order:
--       1. the server retracted requests since the last figures (its KV pool overflowed): the
--          window shrinks to ARGV 7 (a fraction) of what is on the server, but not below the
--          requests that fit below the ceiling at their projected peaks (`total` / `n`: those
--          do not overflow the pool even all at their peaks at once) if it was above that, and
--          holds still for ARGV 8 ms; retractions during the hold come from the same overflow
--          and are only noted;
--       2. the server's own queue is deeper than the target (ARGV 5, or ARGV 6 of its running
--          requests) in these figures and the last ones (a burst of arrivals the scheduler has
--          not taken in yet shows once): the window shrinks to running + target, so tokenmill
--          stops piling up requests the server cannot start yet;
--       3. nothing waits on the server, its KV use is below ARGV 9 of its pool, and the window is
--          what limits tokenmill (a request was refused since the last figures): the window grows
--          by half the requests that would fit below the ceiling beyond the window (or beyond
--          those in flight, if more: slots given back between figures do not count as room) if
--          every request were
--          the size of the running requests' present mean use plus ARGV 13 of the growth
--          admission projects beyond it (the mean projected peak of the requests in flight,
--          `total` / `n`: the safe prior until outputs end), and never smaller than the highest
--          mean use the server has reported since the window started while at least half the
--          window ran (`seen_each`, a fact), nor than the highest such mean plus its rise since
--          the figures before (what the requests would hold by the next figures if none ended:
--          `seen_rise`, a projection, so capped by the mean projected peak now, which falls as
--          the run learns that outputs end early; both start again from the next figures
--          once they are a lifetime old (`seen_ms`) while outputs end at different lengths
--          (`len_dev` a quarter of `len_mean` or more; before any is known, `life_dev` of
--          `life_ms`): requests that end at different lengths desynchronise,
--          and what was seen a lifetime ago was held by requests that have ended, such as a cold
--          start's first batch): sharing the headroom bets that requests are
--          at different stages, and requests that started together (a cold start's first batch;
--          outputs that all run to max_tokens end together, so their successors start together
--          too) reach their peaks together, which that highest mean shows once they have; until as many
--          requests ended since the window started as half of those in flight (the admitted
--          count at the start, `start_admitted` and `start_n`, tell), most of those in flight
--          may have started together and not yet peaked, so each is sized at its whole
--          projected peak (ARGV 13 counts as 1), and what fits is counted below ARGV 14 of the
--          pool (the guard's budget, if lower than the ceiling: sized by projection alone, the
--          window keeps the projection's margin, as the guard did); it jumps while
--          the pool has room for many more, creeps as it fills, and stops where the requests in
--          flight would fill it at that size (by the queue target while nothing sizes a request
--          yet); too much growth is cheap: the server queues what it cannot start and rule 2
--          takes it back;
--       3'. paced (admit.lua starts requests spread over a lifetime while the pool binds and
--          lifetimes agree, see there) and every request in flight started paced (`unpaced` is
--          0): instead of rule 3, and without waiting for a refusal, the window becomes as
--          many as fit below the ceiling (up or down), less room for a group's (ARGV 15)
--          growth from young to peak (a group at its projected peak while no young size is
--          known), at what a request holds on average over its lifetime: halfway between its
--          young size (the least mean use reported while most of the window ran, `use_min`, or
--          the projected peak less the outputs' moving mean length, `len_mean`, whichever is
--          more) and the projected peak, or the mean use reported over time (`use_sum` /
--          `use_n`), or the present mean use, whichever is most; after a retraction of paced
--          requests, never past one fewer than were in flight when it came (`paced_cap`, one
--          fewer again at each retraction);
--       the window never goes below ARGV 10. The first figures start it at what is in flight, and
--       at least at what the guard lets in at the projected peak, and let rule 3 apply at once
--       (until then the token budget decided, not a window); with nothing in flight they start
--       no window and the guard keeps deciding.
-- KEYS: 1 used hash, 2 slots zset (as admit.lua's).
-- ARGV: 1 running, 2 waiting, 3 KV tokens used, 4 KV capacity, 5 queue target (requests),
--       6 queue target (fraction of running), 7 backoff factor, 8 hold after a backoff ms,
--       9 usage ceiling (0-1), 10 smallest window, 11 retractions so far (-1: unknown),
--       12 how long a window stays fresh (ms; admit.lua's ARGV 9), 13 the share of the projected
--       growth a request is sized by (1: its whole projected peak), 14 the guard's budget (a
--       fraction of the pool), 15 the pacing group (admit.lua's ARGV 10; 0: not paced).
-- Also sets `pace_ms` (for status) and `bound` (1: the pool binds; admit.lua paces only then).
-- Every figure read (ARGV, the used hash) is clamped (prelude.lua): garbage reads as 0 (or the
-- field's default), a stamp from the future as now.
-- Returns the new window.
local t = redis.call('TIME')
local now_ms = t[1] * 1000 + math.floor(t[2] / 1000)
local running, waiting = num(ARGV[1], 0, 0), num(ARGV[2], 0, 0)
local used, capacity = num(ARGV[3], 0, 0), num(ARGV[4], 0, 0)
local target = int(math.max(num(ARGV[5], 0, 0), math.ceil(running * num(ARGV[6], 0, 0, 1))), 0, 0)
local smallest, retractions = int(ARGV[10], 1, 1), num(ARGV[11], -1, -1)
local f = redis.call('HMGET', KEYS[1], 'n', 'window', 'srv_retractions', 'hold_until', 'refused',
  'refused_seen', 'srv_waiting', 'total', 'window_ms', 'seen_each', 'admitted', 'start_admitted',
  'start_n', 'srv_running', 'srv_used', 'seen_rise', 'life_ms', 'life_dev', 'use_sum', 'use_n',
  'unpaced', 'use_min', 'paced_cap', 'bound', 'seen_ms', 'len_mean', 'len_dev')
local n = int(f[1], 0, 0)
local admitted = int(f[11], 0, 0)
local refused = int(f[5], 0, 0)
local limiting = refused > int(f[6], 0, 0)
local window = int(f[2], 0, 0)
local first = window <= 0 or now_ms - num(f[9], 0, 0, now_ms) > num(ARGV[12], 0, 0)
if first and n == 0 then
  -- nothing in flight to start a window from: the guard decides until something is (a window
  -- started at the smallest would hold back a cold start the guard lets in at once)
  redis.call('HSET', KEYS[1], 'srv_running', running, 'srv_waiting', waiting, 'srv_used', used,
    'srv_cap', capacity, 'srv_retractions', retractions, 'young_fit', -1)
  return smallest
end
if first then
  -- first figures (or the first after the window went stale and the budget decided): from what
  -- is in flight, free to grow at once
  window = math.max(smallest, n)
  limiting = limiting or n > 0
  f[10], f[16], f[25] = false, false, false  -- and what the requests were seen to hold starts again
  f[12], f[13] = admitted, n  -- as does the count of requests ended under this window
  f[19], f[20], f[22], f[23], f[24] = false, false, false, false, false  -- and what was learned
end
-- paced (admit.lua's rule): requests live about as long as each other, so those that start
-- together end together and their successors start together again; admission starts them
-- spread over a lifetime instead, at most a group (ARGV 15) at a time
local group, life = int(ARGV[15], 0, 0), num(f[17], 0, 0)
-- outputs of about one length: their moving mean deviation (unadmit.lua) is under a quarter of
-- their moving mean; until one is known, lifetimes alike in the same way (admit.lua decides so)
local alike = life > 0 and num(f[18], 0, 0) * 4 < life
local len = num(f[26], 0, 0)
if len > 0 then alike = num(f[27], 0, 0) * 4 < len end
local paced = group > 0 and alike
local use_sum, use_n = num(f[19], 0, 0), num(f[20], 0, 0)
local use_min, paced_cap = num(f[22], 0, 0), int(f[23], 0, 0)
-- requests ended since the window started: those in flight then plus those admitted since, less
-- those in flight now (a slot given back, or expired)
local start_admitted, start_n = int(f[12], 0, 0), int(f[13], 0, 0)
local ended = start_n + admitted - start_admitted - n
-- absent, the counts start from now
start_admitted, start_n = f[12] and start_admitted or admitted, f[13] and start_n or n
local ceiling = num(ARGV[9], 1, 0) * capacity
local present = 0  -- the running requests' mean use now, and the highest seen since the start
if running > 0 then present = used / running end
local peak = 0  -- the requests in flight's mean projected peak
if n > 0 then peak = num(f[8], 0, 0) / n end
if first and peak > 0 then
  -- at least as many as the guard lets in at that size: it may not have had them asking yet
  -- (workers still starting)
  window = math.max(window, math.floor(math.min(ceiling, num(ARGV[14], 1, 0) * capacity) / peak))
end
local seen, seen_rise = num(f[10], 0, 0), num(f[16], 0, 0)
local seen_ms = num(f[25], now_ms, 0, now_ms)
-- outputs that end at different lengths (lifetimes disagree) desynchronise by themselves: the
-- highest mean use seen, once it is a lifetime old, was held by requests that have ended (a cold
-- start's first batch, which started together), not by those in flight, and starts again
if life > 0 and not alike and now_ms - seen_ms > life then
  seen, seen_rise, seen_ms = 0, 0, now_ms
end
-- pacing is for a pool that binds: since the window started, one more request at its projected
-- peak would not have fit the guard's budget (ARGV 14); on a roomy pool it would only delay starts
local bound = f[24] == '1' or (peak > 0 and (n + 1) * peak > num(ARGV[14], 1, 0) * capacity)
paced = paced and bound
-- only while most of the window runs: a few stragglers alone say nothing of requests together
if running * 2 >= window then
  if present >= seen then seen, seen_ms = present, now_ms end
  -- figures come every poll, and requests that peak together may end before the next: what they
  -- hold by then is taken as what they hold now plus the rise since the last figures
  local last_running, last_used = num(f[14], 0, 0), num(f[15], 0, 0)
  local rise = 0
  if last_running > 0 then rise = math.max(0, present - last_used / last_running) end
  seen_rise = math.max(seen_rise, present + rise)
  -- the mean over time of what a request holds: what each holds on average when they are
  -- spread over their lifetimes
  use_sum, use_n = use_sum + present, use_n + 1
  if use_min <= 0 or present < use_min then use_min = present end
end
-- the rise is a projection: never above what the requests in flight are projected to hold now
local held_each = math.max(seen, math.min(seen_rise, peak))
local seen_retractions = num(f[3], -1, -1)
local hold_ms = num(ARGV[8], 0, 0)
local holding = now_ms < num(f[4], 0, 0, now_ms + hold_ms)  -- no hold set now lasts longer
if retractions >= 0 and seen_retractions >= 0 and retractions > seen_retractions then
  if not holding then
    local backed = math.floor(math.min(window, running + waiting) * num(ARGV[7], 0, 0, 1))
    if peak > 0 then backed = math.max(backed, math.min(window, math.floor(ceiling / peak))) end
    -- a retraction of paced requests: that many, at the stages they were at, overflow the pool;
    -- the pacing rule may take the window back up to one fewer than were in flight (another
    -- retraction: one fewer again), not keep it where it backed off to for the rest of the run
    if paced then
      local cap = math.max(smallest, math.min(window, n) - 1)
      if paced_cap > 0 then cap = math.min(cap, paced_cap) end
      paced_cap = cap
    end
    window = backed
    redis.call('HSET', KEYS[1], 'hold_until', now_ms + hold_ms)
    bump(KEYS[1], 'backoffs', 1, 0)
  end
elseif not holding then
  if waiting > target and num(f[7], 0, 0) > target then
    window = math.min(window, running + target)
  elseif paced and int(f[21], 0, 0) <= 0 then
    -- every request in flight started paced: spread over their lifetimes, they hold about
    -- their mean use over time, as those ending make room for those growing: as many as fit at
    -- that size (or what they hold now, if more); pacing fills it gradually
    local each = math.max(present, use_n > 0 and use_sum / use_n or 0)
    -- outputs of one length grow linearly: on average over a lifetime a request holds halfway
    -- between its young size and its projected peak. Its young size: the least mean use seen
    -- (the first figures, which may come at any age of a cold start's batch), or its peak less
    -- the outputs' mean length once one is known, whichever is more. Started a group at a time
    -- and evenly spread, the requests would hold at most a group's half growth more than that
    -- (just before a group ends); they spread less evenly than that (lifetimes move with the
    -- batch, the tail starts together): room is kept for a group's whole growth (for a group
    -- at its peak until a young size is known)
    local young, uneven = use_min, group * peak
    if len > 0 then young = math.max(young, peak - len) end
    if young > 0 then
      young = math.min(young, peak)
      each = math.max(each, (young + peak) / 2)
      uneven = group * (peak - young)
    end
    if waiting <= target and used < ceiling and each > 0 and peak > 0 then
      local fit = math.floor((ceiling - uneven) / each)
      if paced_cap > 0 then fit = math.min(fit, paced_cap) end  -- since a retraction, no more
      -- the fit, up or down: the requests' projected peaks move as the run learns its prompts
      window = fit
    end
  elseif waiting == 0 and limiting and capacity > 0 and used < ceiling then
    -- present use plus ARGV 13 of the growth projected beyond it, at least the highest seen
    -- until as many requests ended as half of those in flight, most of those in flight may have
    -- started together (a cold start's first batch) and will peak together: each is sized at its
    -- whole projected peak
    local share, limit = num(ARGV[13], 1, 0), ceiling
    if ended * 2 < n then share, limit = 1, math.min(ceiling, num(ARGV[14], 1, 0) * capacity) end
    local each = math.max(held_each, present + share * math.max(0, peak - present))
    if each > 0 then  -- half of what still fits at that size (at least one, if any fits)
      local room = math.floor(limit / each) - math.max(n, window)
      if room > 0 then window = window + math.max(1, math.floor(room / 2)) end
    else  -- nothing to size a request by yet
      window = window + target
    end
  end
end
window = int(window, smallest, smallest)
-- what a request holds when it starts, as these figures show it: the size that makes the
-- requests in flight, each grown linearly from it to its projected peak over a lifetime, hold
-- what the server reports now (admit.lua projects the run's tail from it); -1: not known
local young_fit = -1
if life > 0 and running > 0 then
  local held_at_peak, young_share = 0, 0
  for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
    local h = redis.call('HMGET', KEYS[1], 'at:' .. m, 'slot:' .. m)
    if h[1] and h[2] then
      local grown = math.min(1, math.max(0, now_ms - num(h[1], now_ms)) / life)
      held_at_peak, young_share = held_at_peak + num(h[2], 0, 0, SLOT_MAX) * grown, young_share + 1 - grown
    end
  end
  if young_share > 0 then young_fit = math.max(0, (used - held_at_peak) / young_share) end
end
local pace = 0
if paced then pace = math.floor(life / window) end
redis.call('HSET', KEYS[1], 'window', window, 'window_ms', now_ms, 'srv_running', running,
  'srv_waiting', waiting, 'srv_used', used, 'srv_cap', capacity, 'srv_retractions', retractions,
  'refused_seen', refused, 'seen_each', seen, 'seen_rise', seen_rise, 'start_admitted', start_admitted,
  'start_n', start_n, 'pace_ms', pace, 'use_sum', use_sum, 'use_n', use_n, 'use_min', use_min,
  'paced_cap', paced_cap, 'bound', bound and 1 or 0, 'seen_ms', seen_ms, 'young_fit', young_fit)
return window
