-- v_register: register a vLLM worker rank (create its pool or keep it) and, when given, set
-- the world size, atomically with the rank registry.
-- KEYS[1] the rank registry (set of ranks), KEYS[2] the world size, KEYS[3..] the rank's pool
-- keys (store.redis.pool_keys); ARGV[1] rank, ARGV[2] num_pages, ARGV[3] world size or '',
-- ARGV[4] the end of the hold after a data loss, or '' (see _lib.lua init_pool), ARGV[5] '1'
-- when the caller may change a world size already set, '0' when it may only set the first one
-- or the same one (a token without the admin right).
-- Returns [0, created, num_pages], [3, num_pages], or [10, world size] (refused: ARGV[3]
-- would change the world size and ARGV[5] is '0'; nothing was changed).
if ARGV[3] ~= '' and ARGV[5] ~= '1' then
  local world = redis.call('GET', KEYS[2])
  if world and tonumber(world) ~= tonumber(ARGV[3]) then
    return cjson.encode({ 10, tonumber(world) })
  end
end
local out = init_pool(pool_keys_from(KEYS, 3), tonumber(ARGV[2]), ARGV[4])
if out[1] ~= 0 then
  return cjson.encode(out)
end
redis.call('SADD', KEYS[1], ARGV[1])
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[2], ARGV[3])
end
return cjson.encode(out)
