-- hidx_release: a server closing cleanly lets go of its walk of a pool's index build (see
-- _lib.lua hidx_release), so another server with --hash-index takes the walk over at its next
-- initialise of the pool or lookup by hash instead of once the walk has been still for the
-- stale time. Another server's walk, a finished build and a pool not being built (or gone)
-- are left as they are.
-- KEYS the pool's keys; ARGV[1] the server's id (the one its walk's steps claim with).
-- Returns [1] (released) or [0] (nothing of this server's to release).
local k = pool_keys_from(KEYS)
if hidx_release(k, ARGV[1]) then
  return cjson.encode({ 1 })
end
return cjson.encode({ 0 })
