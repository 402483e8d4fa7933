-- confirm: commit (key, page) pairs whose page is RESERVED for the key (already STORED for
-- it: idempotent success; anything else: refused, nothing changes), then release pages whose
-- write failed (FREE only when RESERVED and its last holder lets go; STORED: ignored; a page
-- listed twice is released once).
-- KEYS the pool's keys; ARGV[1] [[[key, page], ...], [page to release, ...]].
-- Returns [0, refused, first refused key, first refused page], [1] (no pool) or
-- [2, field (1 pairs, 2 release), index, n] when a page is outside 0..n-1 (nothing changed).
local k = pool_keys_from(KEYS)
local st = load_state(k)
if not st then
  return cjson.encode({ 1 })
end
local req = cjson.decode(ARGV[1])
local pairs_, release = req[1], req[2]
local function valid(page)
  return type(page) == 'number' and page >= 0 and page < st.n and page % 1 == 0
end
for i, pair in ipairs(pairs_) do
  if not valid(pair[2]) then
    return cjson.encode({ 2, 1, i - 1, st.n })
  end
end
for i, page in ipairs(release) do
  if not valid(page) then
    return cjson.encode({ 2, 2, i - 1, st.n })
  end
end
local now = now_s()
local c = {}
expire(k, now, c)
-- page -> key is read in one batch; pk holds what this call changed (false: now FREE).
-- Commits are written in batches at the end: releases below see them through pk.
local pages = {}
for i, pair in ipairs(pairs_) do
  pages[i] = string.format('%d', pair[2])
end
local before = hmget(k.pk, pages)
local pk = {}
local refused, first_key, first_page = 0, '', -1
local w_pk, w_stored, w_lru, w_pages, w_keys = {}, {}, {}, {}, {}
for i, pair in ipairs(pairs_) do
  local key, page = pair[1], pages[i]
  local v = pk[page]
  if v == nil then
    v = before[i]
  end
  if v == 'R' .. key then
    pk[page] = 'S' .. key
    st.tick = st.tick + 1
    w_pk[#w_pk + 1] = page
    w_pk[#w_pk + 1] = 'S' .. key
    w_stored[#w_stored + 1] = key
    w_stored[#w_stored + 1] = page
    w_lru[#w_lru + 1] = string.format('%d', st.tick)
    w_lru[#w_lru + 1] = page
    w_pages[#w_pages + 1] = page
    w_keys[#w_keys + 1] = key
  elseif v ~= 'S' .. key then
    if refused == 0 then
      first_key, first_page = key, pair[2]
    end
    refused = refused + 1
  end
end
-- The release list is a set: one writer lets go of a page once per call, however often it is
-- listed, or a repeat would drop another writer's hold and free a page still being written.
local released, let_go = 0, {}
for _, p in ipairs(release) do
  local page = string.format('%d', p)
  if not let_go[page] then
    let_go[page] = true
    local v = pk[page]
    if v == nil then
      v = redis.call('HGET', k.pk, page)
    end
    if v and string.sub(v, 1, 1) == 'R' then
      if redis.call('HINCRBY', k.holders, page, -1) <= 0 then
        redis.call('HDEL', k.reserved, string.sub(v, 2))
        redis.call('HDEL', k.holders, page)
        redis.call('ZREM', k.resq, page)
        redis.call('HDEL', k.pk, page)
        pk[page] = false
        free_page(k, page, now)
        released = released + 1
      end
    end
  end
end
if #w_keys > 0 then
  call_many('HDEL', k.reserved, w_keys)
  call_many('HDEL', k.holders, w_pages)
  call_many('ZREM', k.resq, w_pages)
  call_many('HSET', k.pk, w_pk)
  call_many('HSET', k.stored, w_stored)
  call_many('ZADD', k.lru, w_lru)
end
bump(c, 'commits', #w_keys)
bump(c, 'confirms_refused', refused)
bump(c, 'releases', released)
save_state(k, st)
flush(k, c)
return cjson.encode({ 0, refused, first_key, first_page })
