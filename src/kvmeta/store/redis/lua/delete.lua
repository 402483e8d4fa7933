-- delete: STORED keys become FREE (after any live read lease).
-- KEYS the pool's keys; ARGV[1] [key, ...]; ARGV[2] '1': report the keys removed (the change
-- feed, see _lib.lua feed); ARGV[3] the clock-step bound and ARGV[4] (tests only, absent in
-- production) the time in seconds: see pool_now.
-- Returns [0, removed(, [change counter, removed key, ...] when ARGV[2] is '1' and it
-- removed any)] or [1] (no pool).
local k = pool_keys_from(KEYS)
local hx = pool_hx(k)
if hx == nil then
  return cjson.encode({ 1 })
end
local keys = cjson.decode(ARGV[1])
local now = pool_now(k, ARGV[3], ARGV[4])
local c = {}
expire(k, now, c)
local pages = hmget(k.stored, keys)
local gone = {}
local dead_keys, dead_pages = {}, {}
for i = 1, #keys do
  local key, page = keys[i], pages[i]
  if page and not gone[key] then
    gone[key] = true
    dead_keys[#dead_keys + 1] = key
    dead_pages[#dead_pages + 1] = page
  end
end
if #dead_keys > 0 then
  call_many('HDEL', k.stored, dead_keys)
  call_many('ZREM', k.lru, dead_pages)
  call_many('HDEL', k.pk, dead_pages)
  hidx_change(k, hx, dead_keys, dead_pages, false)
  for _, page in ipairs(dead_pages) do
    free_page(k, page, now)
  end
end
bump(c, 'deletes', #dead_keys)
flush(k, c)
if #dead_keys > 0 and ARGV[2] == '1' then
  return cjson.encode({ 0, #dead_keys, feed(k, ARGV[2], dead_keys) })
end
return cjson.encode({ 0, #dead_keys })
