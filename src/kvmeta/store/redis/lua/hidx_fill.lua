-- hidx_fill, one chunk of building a pool's hash index (see _lib.lua hidx_fill_chunk): up to
-- ARGV[2] STORED keys from HSCAN cursor ARGV[1] have their pages added to the index; the chunk
-- whose cursor comes back '0' marks the index complete (meta hx, hb removed). Only the server
-- holding the walk steps (_lib.lua hidx_claim: its own walk, or one released by its server or
-- that has taken no step for ARGV[4] seconds, taken over here); each step stamps its time (meta
-- hbt). A pool not being built (finished by another server, or never marked) is left as it is.
-- KEYS the pool's keys; ARGV[1] HSCAN cursor ('0' starts a walk), ARGV[2] keys per chunk,
-- ARGV[3] the server's id, ARGV[4] the seconds after which a walk without a step counts as
-- stopped.
-- Returns [0, next cursor ('0': done), keys visited], [1] (no pool) or [2] (another server's
-- walk holds the build: this one stops).
local k = pool_keys_from(KEYS)
local flags = redis.call('HMGET', k.meta, 'n', 'hx', 'hb')
if not flags[1] then
  return cjson.encode({ 1 })
end
if flags[2] == '1' or flags[3] ~= '1' then
  return cjson.encode({ 0, '0', 0 })
end
if not hidx_claim(k, ARGV[3], tonumber(ARGV[4])) then
  return cjson.encode({ 2 })
end
local cursor, visited = hidx_fill_chunk(k, ARGV[1], tonumber(ARGV[2]))
if cursor == '0' then
  hidx_built(k)
end
return cjson.encode({ 0, cursor, visited })
