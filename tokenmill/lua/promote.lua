-- promote: publish a delayed retry whose time has come.
-- Pre:  the job is in the delayed set.
-- Post: if its time has come it leaves the delayed set, and if it is still `queued` its
--       message is on the broker list.
-- KEYS: 1 job, 2 delayed, 3 broker.  ARGV: 1 job id, 2 message.
-- Returns 1 when published, else 0.
local now_ms = clock_ms()
local due = redis.call('ZSCORE', KEYS[2], ARGV[1])
if not due or num(due, 0) > now_ms then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('HGET', KEYS[1], 'state') ~= 'queued' then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[2])  -- the front: its wait is over
return 1
