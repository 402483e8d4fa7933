-- hold: Redis lost its data; new pools hand out no never-used page for a while (_lib.lua
-- hold_after_loss, init_pool).
-- KEYS[1] the hold key (kvmeta:2:hold_until); ARGV[1] how long from now, in seconds.
-- Returns [0, the hold's end (seconds of Valkey's time)].
return cjson.encode({ 0, hold_after_loss(KEYS[1], tonumber(ARGV[1])) })
