-- v_clear: drop every vLLM key of every rank; registrations and world size stay so running
-- workers keep working. KEYS[1] vLLM prefix.  Returns [0, cleared].
-- ARGV[1] (tests only, absent in production) the time in seconds: see now_s.
local v = KEYS[1]
local now = now_s(ARGV[1])
local total = 0
for _, rank in ipairs(redis.call('SMEMBERS', v .. 'ranks')) do
  total = total + clear_pool(pool_keys(v .. 'r' .. rank .. ':'), now)
end
return cjson.encode({ 0, total })
