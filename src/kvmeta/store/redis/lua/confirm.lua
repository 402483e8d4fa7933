-- confirm: commit (key, page) pairs whose page is RESERVED for the key (already STORED for
-- it: idempotent success; anything else: refused, nothing changes), then release pages whose
-- write failed (FREE only when RESERVED by a single writer; STORED: ignored); as Pool.confirm.
-- KEYS the pool's keys; ARGV[1] [[[key, page], ...], [page to release, ...]].
-- ARGV[2] '1': report the keys committed (the change feed, see _lib.lua feed); ARGV[3] the
-- clock-step bound and ARGV[4] (tests only, absent in production) the time: see pool_now.
-- Returns [0, refused, first refused key, first refused page(, [change counter, committed
-- key, ...] when ARGV[2] is '1' and it committed any)], [1] (no pool) or
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
local now, pad = pool_now(k, ARGV[3], ARGV[4], st)
local c = {}
expire(k, now, c, st)
-- A pair commits when reserved says its key is RESERVED at its page; stored is read (once) only
-- for the pairs that do not, to tell an idempotent repeat from a refusal. Commits are written
-- in batches at the end (pk already names the key: nothing to write there); committed says
-- what this call changed.
-- Pages as the strings Redis holds: concatenation writes a whole number below 10^14 in
-- plain digits (Lua's %.14g), without a string.format call per page.
local keys, pages = {}, {}
local plain = st.n <= 1e14
for i, pair in ipairs(pairs_) do
  keys[i] = pair[1]
  pages[i] = plain and (pair[2] .. '') or string.format('%d', pair[2])
end
local res_at = hmget(k.reserved, keys)
local committed = {} -- key -> page this call committed
local other = {} -- indexes of pairs not RESERVED as named
local w_stored, w_lru, w_pages, w_keys = {}, {}, {}, {}
for i, key in ipairs(keys) do
  local page = pages[i]
  if committed[key] == nil and res_at[i] == page then
    committed[key] = page
    st.tick = st.tick + 1
    w_stored[#w_stored + 1] = key
    w_stored[#w_stored + 1] = page
    w_lru[#w_lru + 1] = st.tick
    w_lru[#w_lru + 1] = page
    w_pages[#w_pages + 1] = page
    w_keys[#w_keys + 1] = key
  elseif committed[key] ~= page then
    other[#other + 1] = i
  end
end
local refused, first_key, first_page = 0, '', -1
if #other > 0 then
  local other_keys = {}
  for j, i in ipairs(other) do
    other_keys[j] = keys[i]
  end
  local st_at = hmget(k.stored, other_keys)
  for j, i in ipairs(other) do
    -- Already STORED at this page before this call: an idempotent success.
    if st_at[j] ~= pages[i] or committed[keys[i]] ~= nil then
      if refused == 0 then
        first_key, first_page = keys[i], pairs_[i][2]
      end
      refused = refused + 1
    end
  end
end
-- A committed page that other writers joined stays protected like a read page until their
-- lease ends: they may still be writing (the same bytes).
local w_held = {} -- committed pages with an entry in holders (joined by other writers)
if #w_pages > 0 and redis.call('HLEN', k.holders) > 0 then
  local held = hmget(k.holders, w_pages)
  for i, page in ipairs(w_pages) do
    if held[i] then
      w_held[#w_held + 1] = page
    end
    if held[i] and tonumber(held[i]) > 1 then
      local deadline = tonumber(redis.call('ZSCORE', k.resq, page))
      local reading = tonumber(redis.call('ZSCORE', k.reads, page) or '0')
      if deadline > reading then
        redis.call('ZADD', k.reads, fmt(deadline), page)
        lease_end(st, fmt(deadline))
      end
    end
  end
end
-- A page named twice is released once. A page several writers joined is left to a confirm
-- or its lease (a release does not say which writer lets go). A released page cools for
-- RELEASE_GRACE, so a retried copy of this request finds it FREE and changes nothing.
local released = 0
local seen = {}
for _, p in ipairs(release) do
  local page = string.format('%d', p)
  local key = (not seen[page]) and redis.call('HGET', k.pk, page)
  -- RESERVED: its key's reservation is this page (and this call did not just commit it).
  if key and committed[key] == nil and redis.call('HGET', k.reserved, key) == page
      and tonumber(redis.call('HGET', k.holders, page) or '1') <= 1 then
    redis.call('HDEL', k.reserved, key)
    redis.call('HDEL', k.holders, page)
    redis.call('ZREM', k.resq, page)
    redis.call('HDEL', k.pk, page)
    local until_ = now + RELEASE_GRACE + pad
    local reading = tonumber(redis.call('ZSCORE', k.reads, page) or '0')
    if reading > until_ then
      until_ = reading
    end
    redis.call('ZADD', k.cool, fmt(until_), page)
    lease_end(st, fmt(until_))
    released = released + 1
  end
  seen[page] = true
end
if #w_keys > 0 then
  call_many('HDEL', k.reserved, w_keys)
  call_many('HDEL', k.holders, w_held)
  call_many('ZREM', k.resq, w_pages)
  call_many('HSET', k.stored, w_stored)
  call_many('ZADD', k.lru, w_lru)
  hidx_change(k, st.hx, w_keys, w_pages, true)
end
bump(c, 'commits', #w_keys)
bump(c, 'confirms_refused', refused)
bump(c, 'releases', released)
save_state(k, st)
flush(k, c)
if #w_keys > 0 and ARGV[2] == '1' then
  return cjson.encode({ 0, refused, first_key, first_page, feed(k, ARGV[2], w_keys) })
end
return cjson.encode({ 0, refused, first_key, first_page })
