local turn = redis.call('INCR', KEYS[1])
redis.call('ZADD', KEYS[2], 'NX', turn, ARGV[1])
redis.call('ZADD', KEYS[3], 'NX', turn, ARGV[2])
redis.call('XADD', KEYS[4], 'MAXLEN', '1', '*', 'batch', ARGV[1])
return turn
