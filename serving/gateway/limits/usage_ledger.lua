local function ledger_record(usage_key, key_id, model, prompt, completion, expire_at)
  if tonumber(prompt) <= 0 and tonumber(completion) <= 0 then return end
  if tonumber(prompt) > 0 then redis.call('HINCRBY', usage_key, key_id .. '|prompt|' .. model, prompt) end
  if tonumber(completion) > 0 then
    redis.call('HINCRBY', usage_key, key_id .. '|completion|' .. model, completion)
  end
  redis.call('HINCRBY', usage_key, key_id .. '|requests|' .. model, 1)
  redis.call('EXPIREAT', usage_key, expire_at)
end
