-- exists: whether each key is STORED; no LRU touch, no lease expiry (like core.pool).
-- KEYS[1] pool prefix; ARGV keys.  Returns {0, 1|0 ...} or {1} (no pool).
local k = pool_keys(KEYS[1])
if redis.call('HEXISTS', k.meta, 'n') == 0 then
  return { 1 }
end
local out = { 0 }
if #ARGV == 0 then
  return out
end
local pages = redis.call('HMGET', k.stored, unpack(ARGV))
local hits = 0
for i = 1, #ARGV do
  if pages[i] then
    hits = hits + 1
    out[i + 1] = 1
  else
    out[i + 1] = 0
  end
end
flush(k, { exists_hits = hits, exists_misses = #ARGV - hits })
return out
