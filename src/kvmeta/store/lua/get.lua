-- get: page of each STORED key (-1 if none); a use for LRU and a read lease on the page.
-- KEYS[1] pool prefix; ARGV[1] read lease seconds (0: none); ARGV[2..] keys.
-- Returns {0, page|-1 ...} or {1} (no pool).
local k = pool_keys(KEYS[1])
local st = load_state(k)
if not st then
  return { 1 }
end
local now = now_s()
local c = {}
expire(k, now, c)
local lease = tonumber(ARGV[1])
local until_ = fmt(now + lease)
local out = { 0 }
local hits = 0
for i = 2, #ARGV do
  local page = redis.call('HGET', k.stored, ARGV[i])
  if page then
    hits = hits + 1
    touch(k, st, page)
    if lease > 0 then
      redis.call('ZADD', k.reads, until_, page)
    end
    out[i] = tonumber(page)
  else
    out[i] = -1
  end
end
bump(c, 'get_hits', hits)
bump(c, 'get_misses', #ARGV - 1 - hits)
save_state(k, st)
flush(k, c)
return out
