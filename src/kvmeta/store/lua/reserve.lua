-- reserve: per key (1, page) if STORED, (0, page) to write, (0, -1) if no page is free and
-- nothing can be evicted. A key already RESERVED (another writer, a retry, a duplicate in the
-- batch) gets the same page; the first time per call it gains a holder and its lease renews.
-- KEYS the pool's keys; ARGV[1] [reservation lease seconds, [key, ...]].
-- ARGV[2] (tests only, absent in production) the time in seconds: see now_s.
-- Returns [0, hit, page, hit, page, ...] or [1] (no pool).

-- Read-leased pages one call may step over (moving them warm): a fixed allowance plus two per
-- key, as core.pool, so a pool whose pages are all being read costs O(request), not O(pool).
local SCAN_ALLOWANCE = 64

-- A free page (popped ahead into free), else the coldest STORED page without a read lease
-- that this call has not reported as stored (keep); nil if none. Evicted keys go in gone.
local function leased(k, now, page)
  local until_ = redis.call('ZSCORE', k.reads, page)
  return until_ and tonumber(until_) > now
end

-- Evict the STORED page (its key goes in gone); returns the page.
local function evict(k, c, gone, page)
  local v = redis.call('HGET', k.pk, page)
  gone[string.sub(v, 2)] = true
  redis.call('HDEL', k.stored, string.sub(v, 2))
  redis.call('ZREM', k.lru, page)
  redis.call('HDEL', k.pk, page)
  bump(c, 'evictions', 1)
  return page
end

local function take_page(k, st, now, keep, c, free, gone)
  local page
  if free.i <= #free then
    free.i = free.i + 1
    return free[free.i - 1]
  end
  if st.next < st.n then
    page = string.format('%d', st.next)
    st.next = st.next + 1
    return page
  end
  -- The coldest page, when nobody reads it, is evicted without using the scan allowance (as
  -- core.pool's inlined common case); stepping over leased pages starts again from it.
  page = redis.call('ZRANGE', k.lru, 0, 0)[1]
  if page ~= nil and not keep[page] and not leased(k, now, page) then
    return evict(k, c, gone, page)
  end
  local limit = math.min(redis.call('HLEN', k.stored), st.scan_left)
  for _ = 1, limit do
    st.scan_left = st.scan_left - 1
    page = redis.call('ZRANGE', k.lru, 0, 0)[1]
    if page == nil or keep[page] then
      -- Pages reported as stored by this call are the warmest: nothing else is left.
      return nil
    end
    if leased(k, now, page) then
      touch(k, st, page)
    else
      return evict(k, c, gone, page)
    end
  end
  return nil
end

local k = pool_keys_from(KEYS)
local st = load_state(k)
if not st then
  return cjson.encode({ 1 })
end
local req = cjson.decode(ARGV[1])
local keys = req[2]
local now = now_s(ARGV[2])
st.scan_left = SCAN_ALLOWANCE + 2 * #keys
local c = {}
expire(k, now, c)
local deadline = fmt(now + req[1])
-- Reads are batched up front; what this call changes is tracked in local tables: keys it
-- evicted (gone) and keys it reserved (new_res). Writes for new reservations are batched at
-- the end: nothing later in the call reads them (eviction only looks at STORED pages).
local stored_p = hmget(k.stored, keys)
local reserved_p = hmget(k.reserved, keys)
local free = redis.call('RPOP', k.free, #keys) or {}  -- last freed first, as core.pool
free.i = 1
local gone, new_res, seen, hits = {}, {}, {}, {}
local w_pk, w_res, w_hold, w_resq = {}, {}, {}, {}
local out = { 0 }
for i, key in ipairs(keys) do
  local page = (not gone[key]) and stored_p[i]
  local hit = 0
  if page then
    hit = 1
    hits[page] = true
    bump(c, 'reserve_hits', 1)
    touch(k, st, page) -- now: eviction below must see it warm
  else
    page = new_res[key] or reserved_p[i]
    if page then
      if not seen[key] then
        -- Another writer (or a retry) joins: one more holder, lease renewed.
        seen[key] = true
        redis.call('HINCRBY', k.holders, page, 1)
        redis.call('ZADD', k.resq, deadline, page)
      end
    else
      page = take_page(k, st, now, hits, c, free, gone)
      if page then
        local v = page
        bump(c, 'reservations', 1)
        w_pk[#w_pk + 1] = v
        w_pk[#w_pk + 1] = 'R' .. key
        w_res[#w_res + 1] = key
        w_res[#w_res + 1] = v
        w_hold[#w_hold + 1] = v
        w_hold[#w_hold + 1] = 1
        w_resq[#w_resq + 1] = deadline
        w_resq[#w_resq + 1] = v
        new_res[key] = v
        seen[key] = true
      else
        bump(c, 'reservations_refused', 1)
        page = -1
      end
    end
  end
  out[#out + 1] = hit
  out[#out + 1] = tonumber(page)
end
for j = #free, free.i, -1 do -- give back popped pages not used, in their order
  redis.call('RPUSH', k.free, free[j])
end
call_many('HSET', k.pk, w_pk)
call_many('HSET', k.reserved, w_res)
call_many('HSET', k.holders, w_hold)
call_many('ZADD', k.resq, w_resq)
save_state(k, st)
flush(k, c)
return cjson.encode(out)
