-- v_remove: deregister a vLLM worker rank: its pool (keys, reservations, counters) is deleted
-- and it leaves the registry. Idempotent. UNLINK frees a big pool's memory off Redis's main
-- thread. KEYS[1] the rank registry, KEYS[2..] the rank's pool keys (store.redis.pool_keys);
-- ARGV[1] rank; ARGV[2] '1': report the drop (the change feed, see _lib.lua feed).
-- Returns [0, keys dropped(, [change counter] when ARGV[2] is '1')] or [0, -1] (was not
-- registered).
-- The pool's change counter (meta's chg) outlives the pool, alone in meta (where no pool
-- script looks: a pool exists when meta has n), so a rank registered again goes on counting
-- from it and a server ordering this pool's changes never sees the counter go back.
local k = pool_keys_from(KEYS, 2)
local registered = redis.call('SREM', KEYS[1], ARGV[1]) == 1
local stored = redis.call('HLEN', k.stored)
local chg = redis.call('HGET', k.meta, 'chg')
redis.call('UNLINK', unpack(KEYS, 2))
if chg then
  redis.call('HSET', k.meta, 'chg', chg)
end
if registered and ARGV[2] == '1' then
  return cjson.encode({ 0, stored, feed(k, ARGV[2], {}) })
end
return cjson.encode({ 0, registered and stored or -1 })
