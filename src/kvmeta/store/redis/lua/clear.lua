-- clear, one chunk: up to ARGV[2] STORED keys become FREE; reservations in flight stay. The
-- caller repeats with the returned cursor until it is '0', so no call holds Redis (and every
-- other pool on it) for longer than one chunk, and each call leaves the pool consistent.
-- Every key STORED from the first chunk to the last is cleared; one confirmed while the
-- clear runs may be cleared too (HSCAN: visited or not). ARGV[1] '0' starts a clear.
-- KEYS the pool's keys; ARGV[1] HSCAN cursor, ARGV[2] keys per chunk; ARGV[3] '1': the last
-- chunk reports the clear (the change feed, see _lib.lua feed); ARGV[4] the clock-step bound
-- and ARGV[5] (tests only, absent in production) the time in seconds: see pool_now.
-- Returns [0, next cursor, keys cleared by this chunk(, [change counter] from the last chunk
-- when ARGV[3] is '1')] or [1] (no pool).
local k = pool_keys_from(KEYS)
local hx = pool_hx(k)
if hx == nil then
  return cjson.encode({ 1 })
end
local now = pool_now(k, ARGV[4], ARGV[5])
local c = {}
expire(k, now, c)
if ARGV[1] == '0' then
  bump(c, 'clears', 1)
end
local cursor, cleared = clear_chunk(k, now, ARGV[1], tonumber(ARGV[2]), hx)
flush(k, c)
if cursor == '0' and ARGV[3] == '1' then
  return cjson.encode({ 0, cursor, cleared, feed(k, ARGV[3], {}) })
end
return cjson.encode({ 0, cursor, cleared })
