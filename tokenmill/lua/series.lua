-- series: add one point to a time series (a stream), at most one a step, trimmed by age.
-- Pre:  none. Each series has one writer at a time (the lease its writer holds: the pump's lock,
--       a server's load watch, its manager); this script keeps a second writer that overlaps a
--       hand-over, or a writer that calls too often, from adding a point too soon.
-- Post: unless the last point is younger than ARGV 1 ms, or ARGV 3 is 1 and the last point holds
--       the same fields and values, a point (ARGV 5... field/value pairs) is appended with the
--       Redis clock's time as its id; points older than ARGV 2 ms are trimmed (approximately:
--       whole stream nodes); with KEYS 2, ARGV 4 is added to that index set.
-- KEYS: 1 the stream, [2 an index set of the series' owners].
-- ARGV: 1 the least gap between points (ms; 0: none), 2 how long points are kept (ms),
--       3 skip a point equal to the last (0|1), 4 the index member (or ''), 5... field, value.
-- Returns 1 when the point was added, 0 when it was skipped.
local now = clock_ms()
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if last then
  local last_ms = tonumber(string.match(last[1], '^(%d+)'))
  if now - last_ms < num(ARGV[1], 0, 0) then return 0 end
  if ARGV[3] == '1' then
    local prev = last[2]
    local same = #prev == #ARGV - 4
    for i = 1, #prev do same = same and prev[i] == ARGV[i + 4] end
    if same then return 0 end
  end
end
redis.call('XADD', KEYS[1], 'MINID', '~', math.max(0, now - int(ARGV[2], 0, 0)), '*', unpack(ARGV, 5))
if KEYS[2] then redis.call('SADD', KEYS[2], ARGV[4]) end
return 1
