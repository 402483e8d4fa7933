-- check, one chunk: the page invariant over one part of one pool, read-only. The caller walks
-- every part chunk by chunk ('totals' last), so no call holds Redis for longer than a chunk.
-- Each entry is checked against the other structures within one call (atomic), so writes
-- between chunks never produce a false report; 'totals' compares the sizes, O(1), in one call.
-- A pool with the hash index (meta hx) has its index checked both ways, each entry atomically:
-- 'stored' finds each hex-headed key's page under its head, 'hidx' each indexed page's key
-- STORED there with that head, so the index holds exactly the stored keys' heads, each as
-- many times as keys share it. While the index is being built (meta hb) it may lack pages
-- yet, so only the second holds: no page it lists is anything but a STORED key's under its head.
-- KEYS the pool's keys; ARGV[1] part (pk, stored, reserved, free, cool, lru, resq, hidx, totals),
-- ARGV[2] cursor (HSCAN cursor of a hash, start index of a list/zset), ARGV[3] chunk size.
-- Returns [0, next cursor ('0': part done), violation, ...] or [1] (no pool).
local k = pool_keys_from(KEYS)
local st = load_state(k)
if not st then
  return cjson.encode({ 1 })
end
local part, cursor, count = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = { 0, '0' }
local function bad(msg)
  if #out <= 21 then
    out[#out + 1] = msg
  end
end
local function in_range(page, what)
  local p = tonumber(page)
  if p == nil or p < 0 or p >= st.next or p % 1 ~= 0 then
    bad(what .. ' page ' .. page .. ' is outside 0..' .. (st.next - 1))
  end
end
-- A hash chunk by HSCAN, as a flat field/value list; sets the next cursor.
local function hscan(key)
  local scan = redis.call('HSCAN', key, cursor, 'COUNT', count)
  out[2] = scan[1]
  return scan[2]
end
-- A list/zset chunk by index; sets the next cursor unless this is the last chunk.
local function by_index(items)
  if #items == count then
    out[2] = string.format('%d', tonumber(cursor) + count)
  end
  return items
end
local first = tonumber(cursor)
-- Entries are read in a few batched calls per chunk, not several calls per entry.
local function column(flat, from)
  local out = {}
  for i = from, #flat, 2 do
    out[#out + 1] = flat[i]
  end
  return out
end
-- The pages among ``pages`` whose key (``keys``, from pk) points back to them from stored (S)
-- and from reserved (R): true/false lists.
local function states(pages, keys)
  local s_at = hmget(k.stored, keys)
  local s, r, rest, at = {}, {}, {}, {}
  for i, page in ipairs(pages) do
    s[i] = s_at[i] == page
    r[i] = false
    if not s[i] then -- only these can be RESERVED: one more read for them alone
      rest[#rest + 1] = keys[i]
      at[#at + 1] = i
    end
  end
  local r_at = hmget(k.reserved, rest)
  for j, i in ipairs(at) do
    r[i] = r_at[j] == pages[i]
  end
  return s, r
end
if part == 'pk' then
  local flat = hscan(k.pk)
  local pages, keys = column(flat, 1), column(flat, 2)
  local is_s, is_r = states(pages, keys)
  local s_pages, r_pages = {}, {}
  for i, page in ipairs(pages) do
    in_range(page, 'used')
    if is_s[i] then
      s_pages[#s_pages + 1] = page
    elseif is_r[i] then
      r_pages[#r_pages + 1] = page
    else
      bad('page ' .. page .. ' -> ' .. keys[i] .. ' has no matching key entry')
    end
  end
  local s_lru = read_many('ZMSCORE', k.lru, s_pages)
  for i, page in ipairs(s_pages) do
    if not s_lru[i] then
      bad('STORED page ' .. page .. ' is not in the LRU')
    end
  end
  local r_hold = hmget(k.holders, r_pages)
  local r_lease = read_many('ZMSCORE', k.resq, r_pages)
  for i, page in ipairs(r_pages) do
    if r_hold[i] and tonumber(r_hold[i]) < 2 then
      bad('RESERVED page ' .. page .. ' has ' .. r_hold[i] .. ' holders listed (absent: one)')
    end
    if not r_lease[i] then
      bad('RESERVED page ' .. page .. ' has no lease')
    end
  end
  local cooling = read_many('ZMSCORE', k.cool, pages)
  for i, page in ipairs(pages) do
    if cooling[i] then
      bad('page ' .. page .. ' is both FREE (cooling) and in use')
    end
  end
elseif part == 'stored' or part == 'reserved' then
  local flat = hscan(k[part])
  local keys, pages = {}, {}
  for i = 1, #flat, 2 do
    if flat[i] ~= KEEP then
      keys[#keys + 1], pages[#pages + 1] = flat[i], flat[i + 1]
    end
  end
  local at = hmget(k.pk, pages)
  local both = (part == 'stored') and hmget(k.reserved, keys) or {}
  for i, key in ipairs(keys) do
    if at[i] ~= key then
      bad(part .. ' key ' .. key .. ' -> page ' .. pages[i] .. ' disagrees with page -> key')
    end
    if both[i] then
      bad('key ' .. key .. ' is both STORED and RESERVED')
    end
  end
  if part == 'stored' and st.built then
    local heads, at_i = {}, {}
    for i, key in ipairs(keys) do
      local h = head_of(key)
      if h then
        heads[#heads + 1], at_i[#at_i + 1] = h, i
      end
    end
    local listed = hmget(k.hidx, heads)
    for j, h in ipairs(heads) do
      local page, found = pages[at_i[j]], false
      for p in string.gmatch(listed[j] or '', '[^,]+') do
        found = found or p == page
      end
      if not found then
        bad('stored key ' .. keys[at_i[j]] .. ' (page ' .. page .. ') is missing from the '
          .. 'hash index under ' .. h)
      end
    end
  end
elseif part == 'hidx' then
  if not st.hx then
    if redis.call('EXISTS', k.hidx) == 1 then
      bad('hash index present but the pool is not marked as keeping one (meta hx or hb)')
    end
    return cjson.encode(out)
  end
  local flat = hscan(k.hidx)
  local heads, pages, seen = {}, {}, {}
  for i = 1, #flat, 2 do
    local h = flat[i]
    if head_of(h) ~= h then
      bad('hash index field ' .. h .. ' is not 16 lowercase hex digits')
    end
    local any = false
    for page in string.gmatch(flat[i + 1], '[^,]+') do
      any = true
      if seen[page] then
        bad('hash index lists page ' .. page .. ' twice')
      end
      seen[page] = true
      heads[#heads + 1], pages[#pages + 1] = h, page
    end
    if not any then
      bad('hash index field ' .. h .. ' lists no page')
    end
  end
  local keys = hmget(k.pk, pages)
  local s_keys = {}
  for i = 1, #pages do
    s_keys[i] = keys[i] or ''
  end
  local s_at = hmget(k.stored, s_keys)
  for i, page in ipairs(pages) do
    if not keys[i] or s_at[i] ~= page then
      bad('hash index ' .. heads[i] .. ' -> page ' .. page .. ', which is not STORED')
    elseif head_of(keys[i]) ~= heads[i] then
      bad('hash index ' .. heads[i] .. ' -> page ' .. page .. ', whose key ' .. keys[i]
        .. ' has another head')
    end
  end
elseif part == 'free' then
  local pages = by_index(redis.call('LRANGE', k.free, first, first + count - 1))
  local used, cooling, seen = hmget(k.pk, pages), read_many('ZMSCORE', k.cool, pages), {}
  for i, page in ipairs(pages) do
    in_range(page, 'free')
    if seen[page] then
      bad('page ' .. page .. ' is free twice')
    end
    seen[page] = true
    if used[i] then
      bad('page ' .. page .. ' is both FREE and in use')
    end
    if cooling[i] then
      bad('page ' .. page .. ' is both free and cooling')
    end
  end
elseif part == 'cool' or part == 'lru' or part == 'resq' then
  local pages = by_index(redis.call('ZRANGE', k[part], first, first + count - 1))
  if pages[#pages] == KEEP then
    pages[#pages] = nil -- the last (score +inf); by_index has set the cursor already
  end
  local used = hmget(k.pk, pages)
  if part == 'cool' then
    for i, page in ipairs(pages) do
      if used[i] then
        bad('cooling page ' .. page .. ' is in use')
      end
    end
  else
    local keys = {}
    for i = 1, #pages do
      keys[i] = used[i] or ''
    end
    local is_s, is_r = states(pages, keys)
    local want = (part == 'lru') and is_s or is_r
    for i, page in ipairs(pages) do
      if not want[i] then
        bad(part .. ' page ' .. page .. ' is not ' .. (part == 'lru' and 'STORED' or 'RESERVED'))
      end
    end
  end
elseif part == 'totals' then
  local n_stored, n_reserved = redis.call('HLEN', k.stored), reserved_count(k)
  local n_pk, n_lru = redis.call('HLEN', k.pk), redis.call('ZCARD', k.lru)
  local n_holders = redis.call('HLEN', k.holders)
  local n_resq = redis.call('ZCARD', k.resq) - (redis.call('ZSCORE', k.resq, KEEP) and 1 or 0)
  local n_free, n_cool = redis.call('LLEN', k.free), redis.call('ZCARD', k.cool)
  if n_pk ~= n_stored + n_reserved then
    bad('page -> key has ' .. n_pk .. ' entries for ' .. (n_stored + n_reserved) .. ' keys')
  end
  if n_lru ~= n_stored then
    bad('LRU holds ' .. n_lru .. ' pages for ' .. n_stored .. ' STORED keys')
  end
  if n_holders > n_reserved or n_resq ~= n_reserved then
    bad('holders/leases do not match RESERVED keys')
  end
  -- meta's expiry bound must not pass a lease end: expire would skip a lease that ended.
  if st.exp then
    for _, first in ipairs(first_lease_ends(k)) do
      if exp_of(first[2]) < st.exp then
        bad('expiry bound ' .. st.exp .. ' ms is past the ' .. first[3] .. ' of page '
          .. first[1] .. ' at ' .. first[2] .. ' s')
      end
    end
  end
  if st.built and st.hb then
    bad('meta marks the hash index both complete (hx) and being built (hb)')
  end
  local free = n_free + n_cool + st.n - st.next
  if free + n_reserved + n_stored ~= st.n then
    bad('FREE ' .. free .. ' + RESERVED ' .. n_reserved .. ' + STORED ' .. n_stored .. ' != '
      .. st.n)
  end
else
  return redis.error_reply('unknown check part ' .. part)
end
return cjson.encode(out)
