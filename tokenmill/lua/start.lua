-- start: admission and claim in one round trip (the worker's usual way to begin a job).
-- Composed by tokenmill/transitions.py: the bodies of admit.lua and claim.lua are prepended as
-- the local functions admit(KEYS, ARGV) and claim(KEYS, ARGV), so their rules are the same code.
-- Pre:  nothing.
-- Post: when the job can be claimed (claim.lua's precondition) and the server has room
--       (admit.lua's rules), both happen: the slot is held, the job is claimed (claim.lua's
--       post), and its waiting lease is dropped. When it cannot be claimed, nothing is admitted;
--       when there is no room, nothing is claimed (admit.lua records the refusal, as it does).
--       A job of a paused run is neither admitted nor claimed (claim.lua's answer).
-- KEYS: 1 job, 2 counts, 3 leases, 4 delayed (claim.lua's), 5 waiting zset,
--       6 admission slots, 7 admission used (admit.lua's), 8 the run's paused hash (claim.lua's 5th).
-- ARGV: 1 job id, 2 worker, 3 lease ttl ms (claim.lua's), 4... admit.lua's ten ARGV; to them
--       is added its eleventh: the run's jobs still queued (this one included), from the counts.
-- Returns claim.lua's reply, or {'full', ms} when the server has no room (ms > 0: paced, no
-- start is due for that many ms; 0: room comes when a slot is freed).
local now_ms = clock_ms()
local f = redis.call('HMGET', KEYS[1], 'state', 'lease', 'cancel')
local state, lease = f[1], num(f[2], 0)
-- claim.lua's refusals, checked before anything is admitted
local ckeys = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[8]}
if not state or state == 'done' or state == 'failed' or state == 'cancelled' or state == 'sealed'
  or (state == 'running' and (lease > now_ms or f[3])) or redis.call('EXISTS', KEYS[8]) == 1 then
  return claim(ckeys, {ARGV[1], ARGV[2], ARGV[3]})
end
local aargv = {unpack(ARGV, 4)}
local counts, behind = redis.call('HGETALL', KEYS[2]), 0
for i = 1, #counts, 2 do
  if string.sub(counts[i], 1, 7) == 'queued|' then behind = behind + int(counts[i + 1], 0, 0) end
end
aargv[#aargv + 1] = behind
local admitted = admit({KEYS[6], KEYS[7]}, aargv)
if admitted ~= 1 then return {'full', -admitted} end
redis.call('ZREM', KEYS[5], ARGV[1])
return claim(ckeys, {ARGV[1], ARGV[2], ARGV[3]})
