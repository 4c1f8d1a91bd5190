local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now_ms, 'LIMIT', 0, 100)) do
  redis.call('ZREM', KEYS[4], member)
  local line = cjson.decode(member)
  local stream = ARGV[3] .. ':lines:' .. line.batch
  if redis.call('EXISTS', stream) == 1 then
    local fields = {}
    for name, value in pairs(line.fields) do
      fields[#fields + 1] = name
      fields[#fields + 1] = value
    end
    redis.call('XADD', stream, '*', unpack(fields))
    local turn = redis.call('INCR', KEYS[2])
    redis.call('ZADD', ARGV[3] .. ':tenant:' .. line.tenant, 'NX', turn, line.batch)
    redis.call('ZADD', KEYS[1], 'NX', turn, line.tenant)
  end
end
while true do
  local tenant = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if not tenant then break end
  local batches = ARGV[3] .. ':tenant:' .. tenant
  local batch = redis.call('ZRANGE', batches, 0, 0)[1]
  if not batch then
    redis.call('ZREM', KEYS[1], tenant)
  else
    local got = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1,
                            'STREAMS', ARGV[3] .. ':lines:' .. batch, '>')
    if type(got) == 'table' and got.err == nil then
      local turn = redis.call('INCR', KEYS[2])
      redis.call('ZADD', batches, turn, batch)
      redis.call('ZADD', KEYS[1], turn, tenant)
      local entry = got[1][2][1]
      return {batch, entry[1], entry[2]}
    end
    redis.call('ZREM', batches, batch)  -- every line taken, or the batch retired (no stream)
    if redis.call('ZCARD', batches) == 0 then redis.call('ZREM', KEYS[1], tenant) end
  end
end
local last = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)[1]
return {'', last and last[1] or '0-0'}
