-- v_index: the rank registry and world size in one consistent read (the read every
-- cross-rank operation starts from, see v_exists).
-- KEYS[1] the rank registry, KEYS[2] the world size.  Returns [0, world size or '', rank, ...].
local out = { 0, redis.call('GET', KEYS[2]) or '' }
for _, rank in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  out[#out + 1] = rank
end
return cjson.encode(out)
