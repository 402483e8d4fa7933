-- v_register: register a vLLM worker rank (create its pool or keep it) and, when given, set
-- the world size, atomically with the rank registry.
-- KEYS[1] vLLM prefix V (rank r's pool lives under V .. 'r' .. r .. ':'; registry V.ranks,
-- world size V.world); ARGV[1] rank, ARGV[2] num_pages, ARGV[3] world size or ''.
-- Returns [0, created, num_pages] or [3, num_pages].
local v = KEYS[1]
local out = init_pool(pool_keys(v .. 'r' .. ARGV[1] .. ':'), tonumber(ARGV[2]))
if out[1] ~= 0 then
  return cjson.encode(out)
end
redis.call('SADD', v .. 'ranks', ARGV[1])
if ARGV[3] ~= '' then
  redis.call('SET', v .. 'world', ARGV[3])
end
return cjson.encode(out)
