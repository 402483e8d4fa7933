-- exists: whether each key is STORED; no LRU touch, no lease expiry (like core.pool).
-- KEYS the pool's keys; ARGV[1] [key, ...].  Returns [0, 1|0 ...] or [1] (no pool).
local k = pool_keys_from(KEYS)
if redis.call('HEXISTS', k.meta, 'n') == 0 then
  return cjson.encode({ 1 })
end
local keys = cjson.decode(ARGV[1])
local pages = hmget(k.stored, keys)
local out = {}
local hits = 0
for i = 1, #keys do
  if pages[i] then
    hits = hits + 1
    out[i] = '1'
  else
    out[i] = '0'
  end
end
flush(k, { exists_hits = hits, exists_misses = #keys - hits })
if #out == 0 then
  return '[0]'
end
return '[0,' .. table.concat(out, ',') .. ']'
