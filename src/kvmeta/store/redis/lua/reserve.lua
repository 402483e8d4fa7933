-- reserve: per key (1, page) if STORED, (0, page) to write, (0, -1) if no page is free and
-- nothing can be evicted. A key already RESERVED (another writer, a retry, a duplicate in the
-- batch) gets the same page; the first time per call it gains a holder and its lease renews.
-- KEYS the pool's keys; ARGV[1] [reservation lease seconds, [key, ...], whole] (whole 1: all
-- or nothing, below).
-- ARGV[2] '1': report evictions (the change feed, see _lib.lua feed); ARGV[3] the clock-step
-- bound and ARGV[4] (tests only, absent in production) the time in seconds: see pool_now.
-- Returns [0, hit, page, hit, page, ..., [change counter, evicted key, ...] when ARGV[2] is
-- '1' and it evicted] or [1] (no pool).
--
-- Pages come as in core.pool: the free stack (last freed first), then never-used pages, then
-- the coldest STORED page that is not read-leased and not reported as stored by this call.
-- Every read is batched: the LRU's cold end is read once (ZRANGE by rank, with the candidates'
-- read leases and keys), and every change to the LRU (hits touched, leased pages stepped over,
-- evictions) is written once at the end. Until then the sorted set is unchanged, so the LRU as
-- core.pool sees it at any point of the loop is: the pages read from the cold end that this
-- call has not moved or evicted, in order, then (the cold end used up) the pages it moved, in
-- the order of their last move. A request costs a dozen calls however many pages it evicts.

-- Read-leased pages one call may step over (moving them warm): a fixed allowance plus two per
-- key, as core.pool, so a pool whose pages are all being read costs O(request), not O(pool).
local SCAN_ALLOWANCE = 64

local k = pool_keys_from(KEYS)
local st = load_state(k)
if not st then
  return cjson.encode({ 1 })
end
local req = cjson.decode(ARGV[1])
local keys = req[2]
local now, pad = pool_now(k, ARGV[3], ARGV[4], st)
local scan_left = SCAN_ALLOWANCE + 2 * #keys
local c = {}
expire(k, now, c, st)
local deadline = fmt(now + req[1] + pad)
local stored_p = hmget(k.stored, keys)
-- Nothing is RESERVED in a pool no writer is filling right now: skip the read. KEEP is
-- written with the first reservation and never removed, so more than one entry means some.
local reserved_p = {}
if redis.call('HLEN', k.reserved) > 1 then
  reserved_p = hmget(k.reserved, keys)
end
-- Pages this call will need at most (a key evicted by an earlier one of the batch may need
-- one more: every source below is read further on demand).
local need = 0
do
  local counted = {}
  for i, key in ipairs(keys) do
    if not stored_p[i] and not reserved_p[i] and not counted[key] then
      counted[key] = true
      need = need + 1
    end
  end
end

-- The free stack, popped ahead (last freed first); pages not used go back at the end.
local free, free_i, free_more = {}, 1, false
local function pop_free(count)
  local got = redis.call('RPOP', k.free, count)
  if got then
    for _, page in ipairs(got) do
      free[#free + 1] = page
    end
    free_more = #got == count
  else
    free_more = false
  end
end

-- The LRU's cold end, read by rank in chunks: cand (pages), cand_key (their keys),
-- cand_leased; cand_i the next one not yet passed; cand_done when the set has no more.
local cand, cand_key, cand_leased, cand_i, cand_done = {}, {}, {}, 1, false
local has_reads = nil
local function read_cold(count)
  local from = #cand
  local pages = redis.call('ZRANGE', k.lru, from, from + count - 1)
  if #pages < count then
    cand_done = true
  end
  if #pages == 0 then
    return
  end
  if has_reads == nil then
    has_reads = redis.call('ZCARD', k.reads) > 0
  end
  local held = hmget(k.pk, pages)
  local until_ = has_reads and read_many('ZMSCORE', k.reads, pages) or {}
  for i, page in ipairs(pages) do
    cand[from + i] = page
    cand_key[page] = held[i]
    cand_leased[page] = (until_[i] and tonumber(until_[i]) > now) or false
  end
end

local moved, moved_at, evicted, keep = {}, {}, {}, {}
local lru_w = {}
local function move(page) -- to the warm end (a use)
  st.tick = st.tick + 1
  moved[#moved + 1] = page
  moved_at[page] = #moved
  lru_w[#lru_w + 1] = st.tick
  lru_w[#lru_w + 1] = page
end
local moved_i = 1
-- The coldest STORED page right now, nil if none.
local function head()
  while true do
    while cand_i <= #cand do
      local page = cand[cand_i]
      if not moved_at[page] and not evicted[page] then
        return page
      end
      cand_i = cand_i + 1
    end
    if cand_done then
      break
    end
    read_cold(math.max(need, 16))
  end
  while moved_i <= #moved do
    local page = moved[moved_i]
    if moved_at[page] == moved_i then
      return page
    end
    moved_i = moved_i + 1
  end
  return nil
end
local function leased(page)
  local l = cand_leased[page]
  if l == nil then -- a page moved as a hit and never read as a candidate (only keep pages)
    local until_ = redis.call('ZSCORE', k.reads, page)
    l = (until_ and tonumber(until_) > now) or false
    cand_leased[page] = l
  end
  return l
end

-- req[3] 1 (vLLM's batches): the new keys get a page each or none does (core.pool Pool.fits:
-- the same count and walk, the same guarantee). Refused, every key but the STORED ones
-- answers -1 and nothing else changes (lease expiry aside, which any call applies).
if req[3] == 1 and need > 0 then
  local short = need - redis.call('LLEN', k.free)
  if st.next < st.n and not (st.hold and now < st.hold) then
    short = short - (st.n - st.next)
  end
  local batch = {}
  for i = 1, #keys do
    if stored_p[i] then
      batch[stored_p[i]] = true
    end
  end
  -- As the loop below takes pages: one at the cold end that can go costs nothing, one that
  -- cannot costs a step (moved warm), and so does the page a scan then takes. The read-leased
  -- pages stepped over are noted: a refusal moves them warm, as the scans would have.
  local cost, at, scanning, over = 0, 1, false, {}
  while short > 0 do
    if at > #cand and not cand_done then
      read_cold(math.max(short, 16))
    end
    if at > #cand then
      break
    end
    local page = cand[at]
    at = at + 1
    if not batch[page] and not leased(page) then
      if scanning then
        cost, scanning = cost + 1, false
        if cost > scan_left then
          break
        end
      end
      short = short - 1
    else
      cost, scanning = cost + 1, true
      if not batch[page] then
        over[#over + 1] = page
      end
      if cost >= scan_left then
        break
      end
    end
  end
  if short > 0 then
    -- (core.lru stepped_over: the same walk, moving them)
    for _, page in ipairs(over) do
      move(page)
    end
    if #lru_w > 0 then
      call_many('ZADD', k.lru, lru_w)
    end
    local out, refused = {}, 0
    for i = 1, #keys do
      if stored_p[i] then
        out[#out + 1] = '1,' .. stored_p[i]
      else
        refused = refused + 1
        out[#out + 1] = '0,-1'
      end
    end
    bump(c, 'reservations_refused', refused)
    save_state(k, st)
    flush(k, c)
    return '[0,' .. table.concat(out, ',') .. ']'
  end
end
if need > 0 then
  pop_free(need)
end

local w_pk, w_res, w_resq = {}, { KEEP, '' }, { '+inf', KEEP }
local stored_n = nil -- STORED pages left (read when the slow scan first needs it)
local gone, ev_keys, ev_pages = {}, {}, {}
local function evict(page)
  local key = cand_key[page]
  gone[key] = true
  evicted[page] = true
  ev_keys[#ev_keys + 1] = key
  ev_pages[#ev_pages + 1] = page
  return page
end

-- A free page, else a never-used one, else an evicted one (see core.pool); nil if none.
local function take_page()
  if free_i > #free and free_more then
    pop_free(#keys)
  end
  if free_i <= #free then
    free_i = free_i + 1
    return free[free_i - 1]
  end
  -- (Not while the pool holds its never-used pages after a data loss: _lib.lua init_pool.
  -- Nothing is stored or freed in it then, so the rest finds nothing either.)
  if st.next < st.n and not (st.hold and now < st.hold) then
    local page = string.format('%d', st.next)
    st.next = st.next + 1
    return page
  end
  if #cand == 0 and not cand_done then
    -- As many as the keys still to place (#w_pk / 2 placed so far), a few more if pages are
    -- being read (those are stepped over).
    has_reads = redis.call('ZCARD', k.reads) > 0
    read_cold(math.max(need - #w_pk / 2, 1) + (has_reads and 8 or 0))
  end
  -- The coldest page, when nobody reads it, is evicted without using the scan allowance (as
  -- core.pool's inlined common case); stepping over leased pages starts again from it.
  local page = head()
  if page ~= nil and not keep[page] and not leased(page) then
    return evict(page)
  end
  if stored_n == nil then
    stored_n = redis.call('HLEN', k.stored)
  end
  local steps = math.min(stored_n - #ev_pages, scan_left)
  local taken = 0
  while taken < steps do
    taken = taken + 1
    page = head()
    if page == nil or keep[page] then
      -- Pages reported as stored by this call are the warmest: nothing else is left.
      break
    end
    if leased(page) then
      move(page) -- being read: hot, so the read counts as a use
    else
      scan_left = scan_left - taken
      return evict(page)
    end
  end
  scan_left = scan_left - taken
  return nil
end

local new_res, seen = {}, {}
local out = {}
local hits, refused = 0, 0 -- counted here, bumped once below
for i, key in ipairs(keys) do
  local page = (not gone[key]) and stored_p[i]
  if page then
    keep[page] = true
    hits = hits + 1
    move(page) -- now: eviction below must see it warm
    out[2 * i - 1], out[2 * i] = '1', page
  else
    page = new_res[key] or reserved_p[i]
    if page then
      if not seen[key] then
        -- Another writer (or a retry) joins: one more holder, lease renewed.
        seen[key] = true
        if redis.call('HINCRBY', k.holders, page, 1) == 1 then
          redis.call('HINCRBY', k.holders, page, 1) -- absent meant one writer
        end
        redis.call('ZADD', k.resq, deadline, page)
        lease_end(st, deadline)
      end
      out[2 * i - 1], out[2 * i] = '0', page
    else
      page = take_page()
      if page then
        w_pk[#w_pk + 1] = page
        w_pk[#w_pk + 1] = key
        w_res[#w_res + 1] = key
        w_res[#w_res + 1] = page
        w_resq[#w_resq + 1] = deadline
        w_resq[#w_resq + 1] = page
        new_res[key] = page
        seen[key] = true
        out[2 * i - 1], out[2 * i] = '0', page
      else
        refused = refused + 1
        out[2 * i - 1], out[2 * i] = '0', '-1'
      end
    end
  end
end
if free_i <= #free then -- give back popped pages not used, in their order
  local back = {}
  for j = #free, free_i, -1 do
    back[#back + 1] = free[j]
  end
  call_many('RPUSH', k.free, back)
end
-- Evicted pages are all reserved again below (HSET pk overwrites their entry).
if #ev_pages > 0 then
  call_many('HDEL', k.stored, ev_keys)
  call_many('ZREM', k.lru, ev_pages)
  hidx_change(k, st.hx, ev_keys, ev_pages, false)
end
call_many('ZADD', k.lru, lru_w) -- in order: a page moved twice keeps its last tick
call_many('HSET', k.pk, w_pk)
if #w_pk > 0 then
  call_many('HSET', k.reserved, w_res)
  call_many('ZADD', k.resq, w_resq)
  lease_end(st, deadline)
end
bump(c, 'reserve_hits', hits)
bump(c, 'reservations', (#w_pk) / 2)
bump(c, 'reservations_refused', refused)
bump(c, 'evictions', #ev_pages)
save_state(k, st)
flush(k, c)
if #ev_keys > 0 and ARGV[2] == '1' then
  out[#out + 1] = cjson.encode(feed(k, ARGV[2], ev_keys))
end
if #out == 0 then
  return '[0]'
end
return '[0,' .. table.concat(out, ',') .. ']'
