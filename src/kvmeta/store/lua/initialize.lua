-- initialize: create the pool or keep it (a different size is counted as a conflict).
-- KEYS the pool's keys; ARGV[1] num_pages; ARGV[2] '1': the pool keeps the hash index (an
-- SGLang pool on a server with --hash-index); ARGV[3] keys per build chunk (with ARGV[2]).
-- A new pool is marked as keeping it (meta hx). An existing one without it: with at most
-- ARGV[3] stored keys its index is built here (one chunk's work); with more, it is marked as
-- being built (meta hb, see _lib.lua hidx_fill_chunk) and the reply asks the caller to walk it
-- (hidx_fill), as it does for a pool whose build was left unfinished.
-- Returns [0, created, num_pages(, 1: walk the stored keys to build the index)] or
-- [3, num_pages].
local k = pool_keys_from(KEYS)
local out = init_pool(k, tonumber(ARGV[1]))
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
    else
      hidx_stamp(k)
      out[4] = 1
    end
  end
end
return cjson.encode(out)
