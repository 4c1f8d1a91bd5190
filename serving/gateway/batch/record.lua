local status = redis.call('HGET', KEYS[1], 'status')
if status == '"completed"' or status == '"failed"' or status == '"expired"' or status == '"cancelled"' then
  return {0, 0, 0}
end
if redis.call('HEXISTS', KEYS[2], ARGV[2]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[2]) == 1 then
  return {0, redis.call('HLEN', KEYS[2]), redis.call('HLEN', KEYS[3])}
end
if ARGV[1] == 'done' then
  redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
else
  redis.call('HSET', KEYS[3], ARGV[2], ARGV[3])
end
return {1, redis.call('HLEN', KEYS[2]), redis.call('HLEN', KEYS[3])}
