if redis.call('XLEN', KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) end
return 0
