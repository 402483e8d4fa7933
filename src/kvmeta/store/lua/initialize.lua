-- initialize: create the pool or keep it (a different size is counted as a conflict).
-- KEYS the pool's keys; ARGV[1] num_pages.
-- Returns [0, created, num_pages] or [3, num_pages].
return cjson.encode(init_pool(pool_keys_from(KEYS), tonumber(ARGV[1])))
