-- feed: move job ids from a queue's backlog onto the broker, keeping the broker list short.
-- Pre:  ARGV ids are the backlog's first entries (read just before; checked here).
-- Post: those ids left the backlog and their messages are on the broker list; an empty
--       message (a job no longer queued, e.g. cancelled) publishes nothing. If the backlog
--       changed meanwhile nothing is written (the caller reads again).
-- KEYS: 1 backlog, 2 broker.  ARGV: n ids, then n messages.
-- Returns the number of messages published, or -1 when the backlog changed.
local n = #ARGV / 2
local head = redis.call('LRANGE', KEYS[1], 0, n - 1)
if #head ~= n then return -1 end
for i = 1, n do
  if head[i] ~= ARGV[i] then return -1 end
end
redis.call('LTRIM', KEYS[1], n, -1)
local published = 0
for i = 1, n do
  if ARGV[n + i] ~= '' then
    redis.call('LPUSH', KEYS[2], ARGV[n + i])
    published = published + 1
  end
end
return published
