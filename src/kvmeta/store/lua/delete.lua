-- delete: STORED keys become FREE (after any live read lease).
-- KEYS[1] pool prefix; ARGV keys.  Returns {0, removed} or {1} (no pool).
local k = pool_keys(KEYS[1])
if redis.call('HEXISTS', k.meta, 'n') == 0 then
  return { 1 }
end
local now = now_s()
local c = {}
expire(k, now, c)
local removed = 0
for i = 1, #ARGV do
  local page = redis.call('HGET', k.stored, ARGV[i])
  if page then
    redis.call('HDEL', k.stored, ARGV[i])
    redis.call('ZREM', k.lru, page)
    redis.call('HDEL', k.pk, page)
    free_page(k, page, now)
    removed = removed + 1
  end
end
bump(c, 'deletes', removed)
flush(k, c)
return { 0, removed }
