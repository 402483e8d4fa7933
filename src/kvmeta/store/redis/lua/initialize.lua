-- initialize: create the pool or keep it (a different size is counted as a conflict).
-- KEYS the pool's keys; ARGV[1] num_pages; ARGV[2] '1': the pool keeps the hash index (an
-- SGLang pool on a server with --hash-index); with it, ARGV[3] keys per build chunk, ARGV[4]
-- the seconds after which a walk without a step counts as stopped, ARGV[5] the server's id
-- (see _lib.lua hidx_claim); ARGV[6] the end of the hold after a data loss, or '' (see
-- _lib.lua init_pool).
-- A new pool is marked as keeping it (meta hx). An existing one without it: with at most
-- ARGV[3] stored keys its index is built here (one chunk's work); with more, it is marked as
-- being built (meta hb, see _lib.lua hidx_fill_chunk), and the reply asks the caller to walk
-- it (hidx_fill) only if no live walk holds it (_lib.lua hidx_claim): the walk is claimed for
-- the caller in this same step, so a server initialising the pool a moment later leaves the
-- walk to it. A build whose walk stopped is claimed the same way: at once if its server
-- released it (_lib.lua hidx_release), else once that walk has taken no step for ARGV[4]
-- seconds.
-- Returns [0, created, num_pages(, 1: walk the stored keys to build the index)] or
-- [3, num_pages].
local k = pool_keys_from(KEYS)
local out = init_pool(k, tonumber(ARGV[1]), ARGV[6])
if out[1] == 0 and ARGV[2] == '1' then
  local flags = redis.call('HMGET', k.meta, 'hx', 'hb')
  if out[2] == 1 then
    redis.call('HSET', k.meta, 'hx', '1') -- new: nothing stored yet
  elseif flags[1] ~= '1' then
    if flags[2] ~= '1' then
      redis.call('UNLINK', k.hidx) -- (nothing maintained it: no such key, but for a stray one)
      redis.call('HSET', k.meta, 'hb', '1')
    end
    if redis.call('HLEN', k.stored) <= tonumber(ARGV[3]) then
      local cursor = '0'
      repeat
        cursor = hidx_fill_chunk(k, cursor, tonumber(ARGV[3]))
      until cursor == '0'
      hidx_built(k)
    elseif hidx_claim(k, ARGV[5], tonumber(ARGV[4])) then
      out[4] = 1
    end
  end
end
return cjson.encode(out)
