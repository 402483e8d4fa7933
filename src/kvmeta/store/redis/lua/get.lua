-- get: page of each STORED key (-1 if none); a use for LRU and a read lease on the page.
-- KEYS the pool's keys; ARGV[1] [read lease seconds (0: none), [key, ...]].
-- ARGV[2] the clock-step bound and ARGV[3] (tests only, absent in production) the time in
-- seconds: see pool_now.
-- Returns [0, page|-1 ...] or [1] (no pool).
local k = pool_keys_from(KEYS)
local st = load_state(k)
if not st then
  return cjson.encode({ 1 })
end
local req = cjson.decode(ARGV[1])
local lease, keys = req[1], req[2]
local now, pad = pool_now(k, ARGV[2], ARGV[3], st)
local c = {}
expire(k, now, c, st)
local until_ = fmt(now + lease + pad)
local pages = hmget(k.stored, keys)
local out = {}
local lru, reads = {}, {}
local hits = 0
for i = 1, #keys do
  local page = pages[i]
  if page then
    hits = hits + 1
    st.tick = st.tick + 1
    lru[#lru + 1] = st.tick
    lru[#lru + 1] = page
    reads[#reads + 1] = until_
    reads[#reads + 1] = page
    out[i] = page
  else
    out[i] = '-1'
  end
end
-- ZADD applies pairs in order, so a key asked twice keeps its last (warmest) tick.
call_many('ZADD', k.lru, lru)
if lease > 0 then
  call_many('ZADD', k.reads, reads)
  lease_end(st, until_)
end
bump(c, 'get_hits', hits)
bump(c, 'get_misses', #keys - hits)
save_state(k, st)
flush(k, c)
if #out == 0 then
  return '[0]'
end
return '[0,' .. table.concat(out, ',') .. ']'
