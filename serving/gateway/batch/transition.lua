local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local allowed = tonumber(ARGV[1])
local ok = false
for i = 2, allowed + 1 do
  if ARGV[i] == current then ok = true end
end
if not ok then return 0 end
for i = allowed + 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
