-- v_index: the rank registry and world size in one consistent read.
-- KEYS[1] vLLM prefix.  Returns [0, world size or '', rank, ...].
local v = KEYS[1]
local out = { 0, redis.call('GET', v .. 'world') or '' }
for _, rank in ipairs(redis.call('SMEMBERS', v .. 'ranks')) do
  out[#out + 1] = rank
end
return cjson.encode(out)
