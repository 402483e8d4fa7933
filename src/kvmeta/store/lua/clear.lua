-- clear: every STORED page becomes FREE; reservations in flight stay. O(stored).
-- KEYS[1] pool prefix.  Returns [0, cleared] or [1] (no pool).
local k = pool_keys(KEYS[1])
if redis.call('HEXISTS', k.meta, 'n') == 0 then
  return cjson.encode({ 1 })
end
return cjson.encode({ 0, clear_pool(k, now_s()) })
