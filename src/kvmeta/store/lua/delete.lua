-- delete: STORED keys become FREE (after any live read lease).
-- KEYS the pool's keys; ARGV[1] [key, ...].  Returns [0, removed] or [1] (no pool).
-- ARGV[2] (tests only, absent in production) the time in seconds: see now_s.
local k = pool_keys_from(KEYS)
if redis.call('HEXISTS', k.meta, 'n') == 0 then
  return cjson.encode({ 1 })
end
local keys = cjson.decode(ARGV[1])
local now = now_s(ARGV[2])
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
  for _, page in ipairs(dead_pages) do
    free_page(k, page, now)
  end
end
bump(c, 'deletes', #dead_keys)
flush(k, c)
return cjson.encode({ 0, #dead_keys })
