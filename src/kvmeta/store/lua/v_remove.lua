-- v_remove: deregister a vLLM worker rank: its pool (keys, reservations, counters) is deleted
-- and it leaves the registry. Idempotent. UNLINK frees a big pool's memory off Redis's main
-- thread. KEYS[1] the rank registry, KEYS[2..] the rank's pool keys (store.redis.pool_keys);
-- ARGV[1] rank.  Returns [0, keys dropped] or [0, -1] (was not registered).
local k = pool_keys_from(KEYS, 2)
local registered = redis.call('SREM', KEYS[1], ARGV[1]) == 1
local stored = redis.call('HLEN', k.stored)
redis.call('UNLINK', unpack(KEYS, 2))
return cjson.encode({ 0, registered and stored or -1 })
