local function ledger_record(usage_key, key_id, model, prompt, completion, expire_at, overhead_prompt,
                             overhead_completion)
  -- overhead_*: a resumed stream's re-done work, the platform's (absent from older callers: none)
  local redone_prompt, redone_completion = tonumber(overhead_prompt) or 0, tonumber(overhead_completion) or 0
  local billed = tonumber(prompt) > 0 or tonumber(completion) > 0
  if not billed and redone_prompt <= 0 and redone_completion <= 0 then return end
  if tonumber(prompt) > 0 then redis.call('HINCRBY', usage_key, key_id .. '|prompt|' .. model, prompt) end
  if tonumber(completion) > 0 then
    redis.call('HINCRBY', usage_key, key_id .. '|completion|' .. model, completion)
  end
  if redone_prompt > 0 then
    redis.call('HINCRBY', usage_key, key_id .. '|overhead_prompt|' .. model, overhead_prompt)
  end
  if redone_completion > 0 then
    redis.call('HINCRBY', usage_key, key_id .. '|overhead_completion|' .. model, overhead_completion)
  end
  if billed then redis.call('HINCRBY', usage_key, key_id .. '|requests|' .. model, 1) end
  redis.call('EXPIREAT', usage_key, expire_at)
end
