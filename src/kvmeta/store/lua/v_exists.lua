-- v_exists: a key is complete when every required rank has it STORED. Required (as
-- store.base.required_ranks): ranks 0..world-1 when a world size is known (one not registered
-- yet: nothing is complete), else the contiguous run 0..k-1 of registered ranks (a stray rank
-- such as 77 counts for nothing); each of their pools counts exists hits/misses.
-- The caller read the registry first (v_index) and passes the pool keys of the ranks it found
-- required, so every key is in KEYS; if the registry has changed since, so that other ranks
-- are required now, this script changes nothing and answers "stale": the caller reads again.
-- KEYS[1] the rank registry, KEYS[2] the world size, then each required rank's pool keys
-- (store.redis.pool_keys), in ARGV[2]'s order; ARGV[1] [key, ...], ARGV[2] [rank, ...] the
-- required ranks as the caller read them (not empty).
-- Returns [0, 1|0 ...] or [9] (stale).
local STALE = 9
local keys = cjson.decode(ARGV[1])
local want = cjson.decode(ARGV[2])
local world = redis.call('GET', KEYS[2])
local ranks = {}
if world then
  for r = 0, tonumber(world) - 1 do
    if redis.call('SISMEMBER', KEYS[1], string.format('%d', r)) == 0 then
      return cjson.encode({ STALE }) -- the caller saw them all registered
    end
    ranks[#ranks + 1] = r
  end
else
  while redis.call('SISMEMBER', KEYS[1], string.format('%d', #ranks)) == 1 do
    ranks[#ranks + 1] = #ranks
  end
end
if #ranks ~= #want then
  return cjson.encode({ STALE })
end
for i = 1, #ranks do
  if ranks[i] ~= want[i] then
    return cjson.encode({ STALE })
  end
end
-- Like MemoryStore: every required rank's pool counts its exists hits and misses.
local width = (#KEYS - 2) / #want
local ok = {}
for i = 1, #keys do
  ok[i] = true
end
for r = 1, #want do
  local k = pool_keys_from(KEYS, 3 + (r - 1) * width)
  local pages = hmget(k.stored, keys)
  local hits = 0
  for i = 1, #keys do
    if pages[i] then
      hits = hits + 1
    else
      ok[i] = false
    end
  end
  flush(k, { exists_hits = hits, exists_misses = #keys - hits })
end
local out = { 0 }
for i = 1, #keys do
  out[i + 1] = ok[i] and 1 or 0
end
return cjson.encode(out)
