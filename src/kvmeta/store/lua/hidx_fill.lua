-- hidx_fill, one chunk of building a pool's hash index (see _lib.lua hidx_fill_chunk): up to
-- ARGV[2] STORED keys from HSCAN cursor ARGV[1] have their pages added to the index; the chunk
-- whose cursor comes back '0' marks the index complete (meta hx, hb removed); each stamps the
-- time of the step (meta hbt, for a server judging whether the walk stopped). A pool not being
-- built (finished by another server, or never marked) is left as it is.
-- KEYS the pool's keys; ARGV[1] HSCAN cursor ('0' starts a walk), ARGV[2] keys per chunk.
-- Returns [0, next cursor ('0': done), keys visited] or [1] (no pool).
local k = pool_keys_from(KEYS)
local flags = redis.call('HMGET', k.meta, 'n', 'hx', 'hb')
if not flags[1] then
  return cjson.encode({ 1 })
end
if flags[2] == '1' or flags[3] ~= '1' then
  return cjson.encode({ 0, '0', 0 })
end
hidx_stamp(k)
local cursor, visited = hidx_fill_chunk(k, ARGV[1], tonumber(ARGV[2]))
if cursor == '0' then
  hidx_built(k)
end
return cjson.encode({ 0, cursor, visited })
