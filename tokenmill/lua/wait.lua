-- wait: hold (or drop) a waiting lease: a delivered job waits for a server or admission
-- before it is claimed, and the message that carries it lives only in the worker's hands.
-- Pre:  nothing.
-- Post: with ARGV hold = 1 the job is in the waiting set until now + ttl (renewed by each
--       call); with 0 it is gone from it. The pump republishes jobs whose waiting lease expired
--       (their worker died) and that are still queued.
-- KEYS: 1 waiting zset.  ARGV: 1 job id, 2 hold (0|1), 3 ttl ms.
if ARGV[2] == '1' then
  redis.call('ZADD', KEYS[1], clock_ms() + int(ARGV[3], 0, 0), ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
