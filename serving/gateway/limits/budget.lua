local function usd_to_nano(usd)
  local n = tonumber(usd)  -- nil for a missing field (false) or a value nobody should have stored
  if n == nil or n <= 0 then return 0 end
  return math.floor(n * 1000000000 + 0.5)
end
local function budget_check(spend_key, key_id, cost, key_budget, tenant_budget)
  local spent = redis.call('HMGET', spend_key, 'key:' .. key_id, 'tenant')
  local key_spent, tenant_spent = tonumber(spent[1]) or 0, tonumber(spent[2]) or 0
  local c, kb, tb = tonumber(cost), tonumber(key_budget), tonumber(tenant_budget)
  local scope = ''
  if tb > 0 and tenant_spent + c > tb then scope = 'tenant' end
  if kb > 0 and key_spent + c > kb then scope = 'key' end
  return {scope, string.format('%.0f', key_spent), string.format('%.0f', tenant_spent)}
end
local function budget_charge(spend_key, key_id, delta, expire_at)
  if tonumber(delta) == 0 then return end
  redis.call('HINCRBY', spend_key, 'key:' .. key_id, delta)
  redis.call('HINCRBY', spend_key, 'tenant', delta)
  redis.call('EXPIREAT', spend_key, expire_at)
end
