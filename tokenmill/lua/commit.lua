-- commit: record a finished generation. `done` is final.
-- Pre:  the job is `running` under ARGV token (or already `done`: a no-op).
-- Post: the job is `done` with its result; the checkpoint and lease are gone; counts move
--       running -> done; run totals and the throughput bucket grow, and the run's last
--       activity time is now; the job waits in its partition's unsealed set (scored by its
--       enqueue seq) for the sealer; an attempt that started over and threw a checkpoint's
--       tokens away counts them. The run's outputs hash counts one more of ARGV 10, 11 and 12
--       (finish reason, completion-length bin, reasoning-length bin when known); the job is the
--       newest of its partition's recent list, which keeps ARGV 13 ids. With KEYS 9, the run's
--       lengths hash has each field of ARGV 14... raised by the amount after it (the bins the
--       request reached and ended in, and its prompt's sample: tokenmill/lengths.py names them).
--       Quality (ARGV 14 a mask over QUALITY_FLAGS, tokenmill/quality.py; '' = not judged):
--       the run's quality hash counts the job judged and each flag set, in its partition; the
--       mask is the newest of the partition's window (ARGV 15 masks kept: the oldest leave, and
--       the window counts hash loses their flags); `<partition>|n` counts the jobs judged since
--       the run began or was resumed; each worst list (KEYS 14...) gets `partition|job id`,
--       ARGV 13 kept. Then, unless the run is paused, the run's rules are applied to the
--       partition's window rates: the first that trips pauses the run (by 'rule', its reason).
-- KEYS: 1 job, 2 counts, 3 leases, 4 stats, 5 throughput, 6 unsealed(partition), 7 outputs,
--       8 recent(partition), 9 quality, 10 quality window(partition), 11 window counts,
--       12 rules, 13 paused, 14... the worst list of each flag set (ARGV 16 of them),
--       [then the run lengths].
-- ARGV: 1 job id, 2 token, 3 result json, 4 completion tokens, 5 prompt tokens,
--       6 continued tokens, 7 new tokens since the last report, 8 truncated (0|1),
--       9 checkpoint tokens thrown away (a restart), 10 outputs field of the finish reason,
--       11 outputs field of the completion length, 12 of the reasoning length (or ''),
--       13 recent ids kept, 14 quality mask (or ''), 15 window jobs, 16 worst lists,
--       [17... lengths field, amount, field, amount, ...].
-- Returns 'ok', 'done' (already done: nothing written) or 'stale'.
local f = redis.call('HMGET', KEYS[1], 'state', 'token', 'partition', 'seq')
if f[1] == 'done' or f[1] == 'sealed' then return 'done' end
if f[1] ~= 'running' or f[2] ~= ARGV[2] then return 'stale' end
local now_ms = clock_ms()
redis.call('HSET', KEYS[1], 'state', 'done', 'result', ARGV[3], 'done_ms', now_ms,
  'truncated', ARGV[8])
redis.call('HDEL', KEYS[1], 'ckpt_content', 'ckpt_reasoning', 'ckpt_tokens', 'ckpt_prompt', 'lease',
  'worker')
redis.call('ZREM', KEYS[3], ARGV[1])
-- a job enqueued before jobs had a seq is never sealed: its result stays in the job hash
if f[4] then redis.call('ZADD', KEYS[6], num(f[4], 0), ARGV[1]) end
move(KEYS[2], f[3], 'running', 'done')
bump(KEYS[4], 'completion_tokens', ARGV[4], 0)
bump(KEYS[4], 'prompt_tokens', ARGV[5], 0)
redis.call('HSET', KEYS[4], 'last_activity_ms', now_ms)
if int(ARGV[6], 0) > 0 then bumps(KEYS[4], 0, {'continued_jobs', 1, 'continued_tokens', ARGV[6]}) end
if ARGV[8] == '1' then bump(KEYS[4], 'truncated', 1, 0) end
if int(ARGV[9], 0) > 0 then bumps(KEYS[4], 0, {'restarted_jobs', 1, 'discarded_tokens', ARGV[9]}) end
for i = 10, 12 do
  if ARGV[i] ~= '' then bump(KEYS[7], ARGV[i], 1, 0) end
end
local kept = int(ARGV[13], 0, 0)
redis.call('LPUSH', KEYS[8], ARGV[1])
redis.call('LTRIM', KEYS[8], 0, kept - 1)
local worst = int(ARGV[16], 0, 0, #QUALITY_FLAGS)
if ARGV[14] ~= '' then
  local p, mask = f[3], int(ARGV[14], 0, 0, 2 ^ #QUALITY_FLAGS - 1)
  local judged, moves = {p .. '|judged', 1}, {p .. '|n', 1}
  local len = redis.call('LPUSH', KEYS[10], mask)
  -- for each flag set in mask `m`: `p|flag`, `delta` appended to each list of `lists`
  local function add_flags(m, delta, lists)
    for i, flag in ipairs(QUALITY_FLAGS) do
      if floor(m / 2 ^ (i - 1)) % 2 == 1 then
        for _, l in ipairs(lists) do l[#l + 1], l[#l + 2] = p .. '|' .. flag, delta end
      end
    end
  end
  add_flags(mask, 1, {judged, moves})
  while len > int(ARGV[15], 1, 1) do  -- the oldest masks leave the window
    add_flags(int(redis.call('RPOP', KEYS[10]), 0, 0, 2 ^ #QUALITY_FLAGS - 1), -1, {moves})
    len = len - 1
  end
  bumps(KEYS[9], 0, judged)
  bumps(KEYS[11], 0, moves)
  for i = 1, worst do
    redis.call('LPUSH', KEYS[13 + i], p .. '|' .. ARGV[1])
    redis.call('LTRIM', KEYS[13 + i], 0, kept - 1)
  end
  if redis.call('EXISTS', KEYS[13]) == 0 then
    local rules = redis.call('HGETALL', KEYS[12])
    for i = 1, #rules, 2 do
      local op, value, min_jobs, name = string.match(rules[i + 1], '^([<>]) (%S+) (%d+) (%S+)$')
      local flag = QUALITY_RATES[name or '']
      if flag then
        local got = redis.call('HMGET', KEYS[11], p .. '|n', p .. '|' .. flag)
        local rate = int(got[2], 0, 0) / len
        value = num(value, 0)
        local crossed = (op == '>' and rate > value) or (op == '<' and rate < value)
        if crossed and int(got[1], 0, 0) >= int(min_jobs, 1, 1) then
          redis.call('HSET', KEYS[13], 'reason', string.format(
            'quality rule %s tripped on partition %s: %.3f over %d jobs', rules[i], p, rate, len),
            'at_ms', now_ms, 'by', 'rule')
          break
        end
      end
    end
  end
end
local lengths = KEYS[14 + worst]
if lengths then
  for i = 17, #ARGV - 1, 2 do bump(lengths, ARGV[i], ARGV[i + 1], 0) end
end
local n = int(ARGV[7], 0, 0)
if n > 0 then bump(KEYS[5], floor(now_ms / 1000), n, 0) end
return 'ok'
