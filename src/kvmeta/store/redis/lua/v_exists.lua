-- v_exists: one step of the completeness walk (store.redis.RedisBackend.v_exists). A key is
-- complete when every required rank has it STORED. Required (as store.base.required_ranks):
-- ranks 0..n-1, either pinned by the world size n or, without one, the contiguous run of
-- registered ranks from 0 (a stray rank such as 77 counts for nothing).
-- The caller read the registry first (v_index) and walks the required ranks in spans, one
-- script each, passing the keys still complete so far and the pool keys of the span's ranks,
-- so every key is in KEYS and no script does more than a bounded number of lookups. Each
-- script first checks that the registry still requires ranks 0..n-1 (n as the caller read it):
-- if not, it changes nothing and answers "stale", and the caller reads again.
-- Each rank is asked only about the keys every rank before it had, and counts exists hits and
-- misses for those (as MemoryStore.v_exists_steps); the span stops at a rank that has none.
-- KEYS[1] the rank registry, KEYS[2] the world size, then each of the span's ranks' pool keys
-- (store.redis.pool_keys), in rank order; ARGV[1] [key, ...] (not empty), ARGV[2] n, ARGV[3]
-- '1' when n is the world size, '0' when it is the contiguous run.
-- Returns [0, i, ...]: the positions (from 1) in ARGV[1] of the keys every rank of the span
-- has; or [9] (stale).
local STALE = 9
local keys = cjson.decode(ARGV[1])
local n = tonumber(ARGV[2])
local pinned = ARGV[3] == '1'
local world = redis.call('GET', KEYS[2])
if pinned then
  if not world or tonumber(world) ~= n then
    return cjson.encode({ STALE })
  end
elseif world then
  return cjson.encode({ STALE })
end
-- ranks 0..n-1 registered and, without a world size, rank n not (the run ends there): one
-- SMISMEMBER per 1000 ranks
local ranks = {}
for r = 0, pinned and n - 1 or n do
  ranks[#ranks + 1] = string.format('%d', r)
end
local member = read_many('SMISMEMBER', KEYS[1], ranks)
for i = 1, n do
  if member[i] ~= 1 then
    return cjson.encode({ STALE })
  end
end
if not pinned and member[n + 1] ~= 0 then
  return cjson.encode({ STALE })
end
local width = #PARTS
local at = {}
for i = 1, #keys do
  at[i] = i
end
for r = 1, (#KEYS - 2) / width do
  local k = pool_keys_from(KEYS, 3 + (r - 1) * width)
  local pages = hmget(k.stored, keys)
  local kept, kept_at = {}, {}
  for i = 1, #keys do
    if pages[i] then
      kept[#kept + 1] = keys[i]
      kept_at[#kept_at + 1] = at[i]
    end
  end
  flush(k, { exists_hits = #kept, exists_misses = #keys - #kept })
  keys, at = kept, kept_at
  if #keys == 0 then
    break
  end
end
local out = { 0 }
for i = 1, #at do
  out[i + 1] = at[i]
end
return cjson.encode(out)
