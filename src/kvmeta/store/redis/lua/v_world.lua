-- v_world: pin the vLLM world size (ARGV[1] a positive integer) or unpin it (ARGV[1] '').
-- KEYS[1] the world size.  Returns [0].
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return cjson.encode({ 0 })
