-- v_remove: deregister a vLLM worker rank: its pool (keys, reservations, counters) is deleted
-- and it leaves the registry. Idempotent. UNLINK frees a big pool's memory off Redis's main
-- thread. KEYS[1] vLLM prefix; ARGV[1] rank.  Returns [0, keys dropped] or [0, -1] (was not
-- registered).
local v = KEYS[1]
local k = pool_keys(v .. 'r' .. ARGV[1] .. ':')
local registered = redis.call('SREM', v .. 'ranks', ARGV[1]) == 1
local stored = redis.call('HLEN', k.stored)
redis.call('UNLINK', k.meta, k.stored, k.reserved, k.pk, k.holders, k.free, k.lru, k.resq,
           k.reads, k.cool)
return cjson.encode({ 0, registered and stored or -1 })
