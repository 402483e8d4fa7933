-- stats: one pool's occupancy after lease expiry, and its meta hash (counters, conflicts).
-- KEYS the pool's keys.  Returns [0, n, reserved, stored, [meta field, value, ...], cooling]
-- or [1]; cooling: FREE pages not handed out yet (read-leased or just released).
-- ARGV[1] the clock-step bound and ARGV[2] (tests only, absent in production) the time in
-- seconds: see pool_now.
local k = pool_keys_from(KEYS)
local st = load_state(k)
if not st then
  return cjson.encode({ 1 })
end
local c = {}
expire(k, pool_now(k, ARGV[1], ARGV[2]), c)
flush(k, c)
return cjson.encode({ 0, st.n, reserved_count(k), redis.call('HLEN', k.stored),
         redis.call('HGETALL', k.meta), redis.call('ZCARD', k.cool) })
