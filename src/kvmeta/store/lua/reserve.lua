-- reserve: per key (1, page) if STORED, (0, page) to write, (0, -1) if no page is free and
-- nothing can be evicted. A key already RESERVED (another writer, a retry, a duplicate in the
-- batch) gets the same page; the first time per call it gains a holder and its lease renews.
-- KEYS[1] pool prefix; ARGV[1] reservation lease seconds; ARGV[2..] keys.
-- Returns {0, hit, page, hit, page, ...} or {1} (no pool).

-- Upper bound on LRU entries looked at per eviction (read-leased pages are moved warm).
local EVICT_SCAN_LIMIT = 4096

-- A free page, else the coldest STORED page without a read lease that this call has not
-- reported as stored (keep); nil if none.
local function take_page(k, st, now, keep, c)
  local page = redis.call('RPOP', k.free)
  if page then
    return page
  end
  if st.next < st.n then
    page = string.format('%d', st.next)
    st.next = st.next + 1
    return page
  end
  local limit = math.min(redis.call('HLEN', k.stored), EVICT_SCAN_LIMIT)
  for _ = 1, limit do
    page = redis.call('ZRANGE', k.lru, 0, 0)[1]
    if page == nil or keep[page] then
      -- Pages reported as stored by this call are the warmest: nothing else is left.
      return nil
    end
    local until_ = redis.call('ZSCORE', k.reads, page)
    if until_ and tonumber(until_) > now then
      touch(k, st, page)
    else
      local v = redis.call('HGET', k.pk, page)
      redis.call('HDEL', k.stored, string.sub(v, 2))
      redis.call('ZREM', k.lru, page)
      redis.call('HDEL', k.pk, page)
      bump(c, 'evictions', 1)
      return page
    end
  end
  return nil
end

local k = pool_keys(KEYS[1])
local st = load_state(k)
if not st then
  return { 1 }
end
local now = now_s()
local c = {}
expire(k, now, c)
local deadline = fmt(now + tonumber(ARGV[1]))
local out = { 0 }
local seen = {}
local hits = {}
for i = 2, #ARGV do
  local key = ARGV[i]
  local page = redis.call('HGET', k.stored, key)
  local hit = 0
  if page then
    hit = 1
    hits[page] = true
    bump(c, 'reserve_hits', 1)
    touch(k, st, page)
  else
    page = redis.call('HGET', k.reserved, key)
    if page then
      if not seen[key] then
        seen[key] = true
        redis.call('HINCRBY', k.holders, page, 1)
        redis.call('ZADD', k.resq, deadline, page)
      end
    else
      page = take_page(k, st, now, hits, c)
      if page then
        bump(c, 'reservations', 1)
        redis.call('HSET', k.pk, page, 'R' .. key)
        redis.call('HSET', k.reserved, key, page)
        redis.call('HSET', k.holders, page, 1)
        redis.call('ZADD', k.resq, deadline, page)
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
save_state(k, st)
flush(k, c)
return out
