-- initialize: create the pool or keep it (a different size is counted as a conflict).
-- KEYS the pool's keys; ARGV[1] num_pages; ARGV[2] '1': the pool keeps the hash index (an
-- SGLang pool on a server with --hash-index): a new pool is marked so (meta hx), an existing
-- one without it gets its index built from its stored keys first (hidx_build: O(stored), once).
-- Returns [0, created, num_pages] or [3, num_pages].
local k = pool_keys_from(KEYS)
local out = init_pool(k, tonumber(ARGV[1]))
if out[1] == 0 and ARGV[2] == '1' and redis.call('HGET', k.meta, 'hx') ~= '1' then
  if out[2] == 1 then
    redis.call('HSET', k.meta, 'hx', '1') -- new: nothing stored yet
  else
    hidx_build(k)
  end
end
return cjson.encode(out)
