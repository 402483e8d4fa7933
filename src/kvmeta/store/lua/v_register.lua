-- v_register: register a vLLM worker rank (create its pool or keep it) and, when given, set
-- the world size, atomically with the rank registry.
-- KEYS[1] the rank registry (set of ranks), KEYS[2] the world size, KEYS[3..] the rank's pool
-- keys (store.redis.pool_keys); ARGV[1] rank, ARGV[2] num_pages, ARGV[3] world size or '',
-- ARGV[4] the end of the hold after a data loss, or '' (see _lib.lua init_pool).
-- Returns [0, created, num_pages] or [3, num_pages].
local out = init_pool(pool_keys_from(KEYS, 3), tonumber(ARGV[2]), ARGV[4])
if out[1] ~= 0 then
  return cjson.encode(out)
end
redis.call('SADD', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[2], ARGV[3])
end
return cjson.encode(out)
