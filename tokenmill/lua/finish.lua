-- finish: commit and give the admission slot back in one round trip.
-- Composed by tokenmill/transitions.py: the bodies of commit.lua and unadmit.lua are prepended as
-- the local functions commit(KEYS, ARGV) and unadmit(KEYS, ARGV).
-- Pre:  as commit.lua.
-- Post: commit.lua's post; and whatever the commit's verdict, the slot is released (unadmit.lua).
-- KEYS: commit.lua's (8 or 9), then 2 admission slots, 1 admission used (the last two).
-- ARGV: commit.lua's, then the slot member and the tokens the attempt generated (the last two).
-- Returns commit.lua's reply.
local nk, na = #KEYS, #ARGV
local verdict = commit({unpack(KEYS, 1, nk - 2)}, {unpack(ARGV, 1, na - 2)})
unadmit({KEYS[nk - 1], KEYS[nk]}, {ARGV[na - 1], ARGV[na]})
return verdict
