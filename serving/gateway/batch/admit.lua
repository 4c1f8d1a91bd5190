local t_count, t_bytes, a_count, a_bytes = 0, 0, 0, 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local got = redis.call('HMGET', ARGV[9] .. id .. '}', 'tenant', 'footprint')
  if got[1] then
    local bytes = tonumber(got[2]) or 0
    a_count, a_bytes = a_count + 1, a_bytes + bytes
    if got[1] == ARGV[1] then t_count, t_bytes = t_count + 1, t_bytes + bytes end
  end
end
local need = tonumber(ARGV[2])
if t_count + 1 > tonumber(ARGV[3]) then return {'tenant_batches', t_count, t_bytes} end
if t_bytes + need > tonumber(ARGV[4]) then return {'tenant_bytes', t_count, t_bytes} end
if a_count + 1 > tonumber(ARGV[5]) then return {'gateway_batches', a_count, a_bytes} end
if a_bytes + need > tonumber(ARGV[6]) then return {'gateway_bytes', a_count, a_bytes} end
for i = 10, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[7])
redis.call('SADD', KEYS[1], ARGV[7])
return {'', t_count + 1, t_bytes + need}
