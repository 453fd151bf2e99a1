-- qref_sample: hand a committed job to the reference scorer when it is sampled.
-- Pre:  the run names a reference (the worker checks its `qref` configuration first).
-- Post: if ARGV 3 is 1 (drawn by the sampling fraction) or fewer than ARGV 4 of the partition's
--       jobs were sampled so far, ARGV 2 (the job's scoring entry) is pushed at the head of the
--       to-do list, which keeps its newest ARGV 5 entries, and the partition's sampled count
--       (field ARGV 1) grows by one. Otherwise nothing is written.
-- KEYS: 1 qref hash, 2 the to-do list.
-- ARGV: 1 the partition's `sampled` field, 2 the entry, 3 drawn (0|1), 4 the least sampled,
--       5 the to-do list's cap.
-- Returns the partition's sampled count (after the push, if any).
local sampled = int(redis.call('HGET', KEYS[1], ARGV[1]), 0, 0)
if ARGV[3] ~= '1' and sampled >= int(ARGV[4], 0, 0) then return sampled end
redis.call('LPUSH', KEYS[2], ARGV[2])
redis.call('LTRIM', KEYS[2], 0, int(ARGV[5], 1, 1) - 1)
return bump(KEYS[1], ARGV[1], 1, 0)
