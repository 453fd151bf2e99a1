-- pause: stop a run's claims (by hand, or by a quality rule judged outside commit.lua).
-- Pre:  nothing.
-- Post: the run's paused hash holds ARGV reason, when (Redis clock, ms) and by whom, unless the
--       run was already paused (the first pause is kept). Claims answer 'paused' while it exists;
--       running jobs finish and commit.
-- KEYS: 1 the run's paused hash.  ARGV: 1 reason, 2 by (rule | person).
-- Returns 1 when the run was paused now, 0 when it already was.
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'reason', ARGV[1], 'at_ms', clock_ms(), 'by', ARGV[2])
return 1
