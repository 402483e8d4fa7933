-- v_exists: a key is complete when every required rank has it STORED. Required (as
-- store.base.required_ranks): ranks 0..world-1 when a world size is known (one not registered
-- yet: nothing is complete), else the contiguous run 0..k-1 of registered ranks (a stray rank
-- such as 77 counts for nothing); each of their pools counts exists hits/misses.
-- KEYS[1] vLLM prefix; ARGV[1] [key, ...].  Returns [0, 1|0 ...].
local v = KEYS[1]
local keys = cjson.decode(ARGV[1])
local out = { 0 }
local world = redis.call('GET', v .. 'world')
local ranks
if world then
  ranks = {}
  for r = 0, tonumber(world) - 1 do
    local rank = string.format('%d', r)
    if redis.call('SISMEMBER', v .. 'ranks', rank) == 0 then
      ranks = {}
      break
    end
    ranks[#ranks + 1] = rank
  end
else
  ranks = {}
  while redis.call('SISMEMBER', v .. 'ranks', string.format('%d', #ranks)) == 1 do
    ranks[#ranks + 1] = string.format('%d', #ranks)
  end
end
-- Like MemoryStore: every required rank's pool counts its exists hits and misses.
local ok = {}
for i = 1, #keys do
  ok[i] = #ranks > 0
end
for _, rank in ipairs(ranks) do
  local k = pool_keys(v .. 'r' .. rank .. ':')
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
for i = 1, #keys do
  out[i + 1] = ok[i] and 1 or 0
end
return cjson.encode(out)
