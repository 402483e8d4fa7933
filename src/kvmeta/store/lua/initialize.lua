-- initialize: create the pool or keep it (a different size is counted as a conflict).
-- KEYS[1] pool prefix; ARGV[1] num_pages.  Returns [0, created, num_pages] or [3, num_pages].
return cjson.encode(init_pool(pool_keys(KEYS[1]), tonumber(ARGV[1])))
