-- confirm: commit (key, page) pairs whose page is RESERVED for the key (already STORED for
-- it: idempotent success; anything else: refused, nothing changes), then release pages whose
-- write failed (FREE only when RESERVED and its last holder lets go; STORED: ignored).
-- KEYS[1] pool prefix; ARGV[1] number of pairs m; ARGV[2..2m+1] key, page, ...; then the
-- pages to release.
-- Returns {0, refused, first refused key, first refused page}, {1} (no pool) or
-- {2, field (1 pairs, 2 release), page} when a page is outside 0..n-1 (nothing changed).
local k = pool_keys(KEYS[1])
local st = load_state(k)
if not st then
  return { 1 }
end
local m = tonumber(ARGV[1])
local first_release = 2 * m + 2
for i = 2, #ARGV do
  if i < first_release and i % 2 == 0 then
    -- a key, not a page
  else
    local page = tonumber(ARGV[i])
    if page == nil or page < 0 or page >= st.n or page % 1 ~= 0 then
      return { 2, (i < first_release) and 1 or 2, ARGV[i], st.n }
    end
  end
end
local now = now_s()
local c = {}
expire(k, now, c)
local refused, first_key, first_page = 0, '', -1
local committed = 0
for i = 2, first_release - 1, 2 do
  local key, page = ARGV[i], ARGV[i + 1]
  local v = redis.call('HGET', k.pk, page)
  if v == 'R' .. key then
    redis.call('HDEL', k.reserved, key)
    redis.call('HDEL', k.holders, page)
    redis.call('ZREM', k.resq, page)
    redis.call('HSET', k.pk, page, 'S' .. key)
    redis.call('HSET', k.stored, key, page)
    touch(k, st, page)
    committed = committed + 1
  elseif v ~= 'S' .. key then
    if refused == 0 then
      first_key, first_page = key, tonumber(page)
    end
    refused = refused + 1
  end
end
local released = 0
for i = first_release, #ARGV do
  local page = ARGV[i]
  local v = redis.call('HGET', k.pk, page)
  if v and string.sub(v, 1, 1) == 'R' then
    if redis.call('HINCRBY', k.holders, page, -1) <= 0 then
      redis.call('HDEL', k.reserved, string.sub(v, 2))
      redis.call('HDEL', k.holders, page)
      redis.call('ZREM', k.resq, page)
      redis.call('HDEL', k.pk, page)
      free_page(k, page, now)
      released = released + 1
    end
  end
end
bump(c, 'commits', committed)
bump(c, 'confirms_refused', refused)
bump(c, 'releases', released)
save_state(k, st)
flush(k, c)
return { 0, refused, first_key, first_page }
