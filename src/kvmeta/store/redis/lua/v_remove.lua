-- v_remove: deregister a vLLM worker rank: its pool (keys, reservations, counters) is deleted
-- and it leaves the registry. Idempotent. UNLINK frees a big pool's memory off Redis's main
-- thread. KEYS[1] the rank registry, KEYS[2..] the rank's pool keys (store.redis.pool_keys);
-- ARGV[1] rank; ARGV[2] '1': force; ARGV[3] '1': report the drop (the change feed, see
-- _lib.lua feed); ARGV[4] the clock-step bound and ARGV[5] (tests only, absent in production) the time in
-- seconds: see pool_now.
-- Returns [0, keys dropped(, [change counter] when ARGV[3] is '1')], [0, -1] (was not
-- registered) or, changing nothing, [5, pages reserved, seconds until the last lease on its
-- pages ends] when one is live and ARGV[2] is not '1' (as core.pool in_use_until: registered
-- again, the rank would hand those pages to new blocks while they may be written or read).
-- The pool's change counter (meta's chg) outlives the pool, alone in meta (where no pool
-- script looks: a pool exists when meta has n), so a rank registered again goes on counting
-- from it and a server ordering this pool's changes never sees the counter go back.
local k = pool_keys_from(KEYS, 2)
if ARGV[2] ~= '1' and redis.call('HEXISTS', k.meta, 'n') == 1 then
  local now = pool_now(k, ARGV[4], ARGV[5])
  local c = {}
  expire(k, now, c)
  flush(k, c)
  local until_ = now
  local function later(last)
    if last[2] and tonumber(last[2]) > until_ then
      until_ = tonumber(last[2])
    end
  end
  later(redis.call('ZREVRANGEBYSCORE', k.resq, '(+inf', '-inf', 'WITHSCORES', 'LIMIT', 0, 1))
  later(redis.call('ZRANGE', k.reads, -1, -1, 'WITHSCORES'))
  later(redis.call('ZRANGE', k.cool, -1, -1, 'WITHSCORES'))
  if until_ > now then
    return cjson.encode({ 5, reserved_count(k), until_ - now })
  end
end
local registered = redis.call('SREM', KEYS[1], ARGV[1]) == 1
local stored = redis.call('HLEN', k.stored)
local chg = redis.call('HGET', k.meta, 'chg')
redis.call('UNLINK', unpack(KEYS, 2))
if chg then
  redis.call('HSET', k.meta, 'chg', chg)
end
if registered and ARGV[3] == '1' then
  return cjson.encode({ 0, stored, feed(k, ARGV[3], {}) })
end
return cjson.encode({ 0, registered and stored or -1 })
