-- v_world: pin the vLLM world size (ARGV[1] a positive integer) or unpin it (ARGV[1] '').
-- KEYS[1] vLLM prefix.  Returns [0].
local v = KEYS[1]
if ARGV[1] == '' then
  redis.call('DEL', v .. 'world')
else
  redis.call('SET', v .. 'world', ARGV[1])
end
return cjson.encode({ 0 })
