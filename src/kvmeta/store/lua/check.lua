-- check: the full page invariant of one pool, O(pool): for tests and diagnostics only.
-- KEYS[1] pool prefix.  Returns [0, violation, ...] (none: consistent) or [1].
local k = pool_keys(KEYS[1])
local st = load_state(k)
if not st then
  return cjson.encode({ 1 })
end
local out = { 0 }
local function bad(msg)
  if #out <= 20 then
    out[#out + 1] = msg
  end
end
local function as_map(flat)
  local m, count = {}, 0
  for i = 1, #flat, 2 do
    m[flat[i]] = flat[i + 1]
    count = count + 1
  end
  return m, count
end
local function as_set(list)
  local s, count = {}, 0
  for _, x in ipairs(list) do
    if s[x] then
      bad('page ' .. x .. ' appears twice in one structure')
    end
    s[x] = true
    count = count + 1
  end
  return s, count
end
local stored, n_stored = as_map(redis.call('HGETALL', k.stored))
local reserved, n_reserved = as_map(redis.call('HGETALL', k.reserved))
local pk, n_pk = as_map(redis.call('HGETALL', k.pk))
local holders, n_holders = as_map(redis.call('HGETALL', k.holders))
local lru, n_lru = as_set(redis.call('ZRANGE', k.lru, 0, -1))
local resq, n_resq = as_set(redis.call('ZRANGE', k.resq, 0, -1))
local free, n_free = as_set(redis.call('LRANGE', k.free, 0, -1))
local cool, n_cool = as_set(redis.call('ZRANGE', k.cool, 0, -1))
for key, page in pairs(stored) do
  if pk[page] ~= 'S' .. key then bad('stored key ' .. key .. ' -> page ' .. page .. ' disagrees with page -> key') end
  if not lru[page] then bad('STORED page ' .. page .. ' is not in the LRU') end
  if reserved[key] then bad('key ' .. key .. ' is both STORED and RESERVED') end
end
for key, page in pairs(reserved) do
  if pk[page] ~= 'R' .. key then bad('reserved key ' .. key .. ' -> page ' .. page .. ' disagrees with page -> key') end
  if not holders[page] or tonumber(holders[page]) < 1 then bad('RESERVED page ' .. page .. ' has no holder') end
  if not resq[page] then bad('RESERVED page ' .. page .. ' has no lease') end
end
for page, v in pairs(pk) do
  local p = tonumber(page)
  if p == nil or p < 0 or p >= st.next then bad('page ' .. page .. ' is outside 0..' .. (st.next - 1)) end
  local map = (string.sub(v, 1, 1) == 'S') and stored or reserved
  if map[string.sub(v, 2)] ~= page then bad('page ' .. page .. ' -> ' .. v .. ' has no matching key entry') end
  if free[page] or cool[page] then bad('page ' .. page .. ' is both FREE and in use') end
end
for page in pairs(cool) do
  if free[page] then bad('page ' .. page .. ' is both free and cooling') end
end
for page in pairs(free) do
  local p = tonumber(page)
  if p == nil or p < 0 or p >= st.next then bad('free page ' .. page .. ' is outside 0..' .. (st.next - 1)) end
end
if n_pk ~= n_stored + n_reserved then bad('page -> key has ' .. n_pk .. ' entries for ' .. (n_stored + n_reserved) .. ' keys') end
if n_lru ~= n_stored then bad('LRU holds ' .. n_lru .. ' pages for ' .. n_stored .. ' STORED keys') end
if n_holders ~= n_reserved or n_resq ~= n_reserved then bad('holders/leases do not match RESERVED keys') end
local total = n_free + n_cool + (st.n - st.next) + n_stored + n_reserved
if total ~= st.n then
  bad('FREE ' .. (n_free + n_cool + st.n - st.next) .. ' + RESERVED ' .. n_reserved .. ' + STORED ' .. n_stored .. ' != ' .. st.n)
end
return cjson.encode(out)
