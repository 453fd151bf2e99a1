-- unpause: lift a run's pause (a person's or a rule's) and re-arm its quality rules.
-- Pre:  nothing.
-- Post: the run is not paused; every partition's quality window and the window counts are
--       gone, so the rules judge only jobs committed from now on (the run's quality hash,
--       counted since it began, stays).
-- KEYS: 1 the run's paused hash, 2 the window counts, 3... each partition's quality window.
-- ARGV: none.
-- Returns the reason of the pause lifted, or '' when the run was not paused.
local reason = redis.call('HGET', KEYS[1], 'reason') or ''
for i = 1, #KEYS do redis.call('DEL', KEYS[i]) end
return reason
