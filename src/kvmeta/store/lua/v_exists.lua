-- v_exists: a key is complete when every required rank has it STORED. Required: ranks
-- 0..world-1 when a world size is known (none registered yet: nothing is complete), else
-- every registered rank. KEYS[1] vLLM prefix; ARGV[1] [key, ...].  Returns [0, 1|0 ...].
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
  ranks = redis.call('SMEMBERS', v .. 'ranks')
end
for i, key in ipairs(keys) do
  local ok = #ranks > 0 and 1 or 0
  for _, rank in ipairs(ranks) do
    if redis.call('HEXISTS', v .. 'r' .. rank .. ':stored', key) == 0 then
      ok = 0
      break
    end
  end
  out[i + 1] = ok
end
return cjson.encode(out)
