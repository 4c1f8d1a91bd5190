local refund, admitted_day = tonumber(ARGV[3]), tonumber(ARGV[5])
local function settle_tokens(base, tpm)
  -- Move the token TAT back by the unused tokens, never below now: a refund cannot bank capacity.
  if tpm > 0 then save_tat(KEYS[base + 1], tat_of(KEYS[base + 1]) - refund * (MINUTE / tpm)) end
  -- The refund belongs to the day the reservation was charged to; once another day is being
  -- counted, that day's counter is not this request's to change.
  local daily = redis.call('HMGET', KEYS[base + 3], 'day', 'used')
  if tonumber(daily[1]) == admitted_day then
    redis.call('HSET', KEYS[base + 3], 'used', num(math.max(0, (tonumber(daily[2]) or 0) - refund)))
  end
end
if ARGV[7] == '1' then
  if ARGV[6] == '1' then settle_tokens(1, tonumber(ARGV[1])) end
  settle_tokens(5, tonumber(ARGV[2]))
end
if ARGV[8] == '1' then
  if ARGV[11] == '1' then save_tat(KEYS[1], tat_of(KEYS[1]) - MINUTE / tonumber(ARGV[9])) end
  if tonumber(ARGV[10]) > 0 then save_tat(KEYS[5], tat_of(KEYS[5]) - MINUTE / tonumber(ARGV[10])) end
end
redis.call('ZREM', KEYS[3], ARGV[4])
redis.call('ZREM', KEYS[7], ARGV[4])
-- Cost accounting last, and unable to fail the script: a script is not rolled back on error, so
-- an error here must not be able to keep the slot above taken. Numbers are checked to be
-- integers before use, and pcall catches what Redis itself could refuse (a key of another type).
local function integer(x) return type(x) == 'string' and string.match(x, '^%-?%d+$') ~= nil end
if integer(ARGV[13]) and integer(ARGV[14]) and ARGV[13] ~= '0' then
  pcall(budget_charge, KEYS[10], ARGV[12], ARGV[13], ARGV[14])
end
local ledger_numbers = integer(ARGV[16]) and integer(ARGV[17]) and integer(ARGV[18])
if ledger_numbers and integer(ARGV[19]) and integer(ARGV[20]) then
  pcall(ledger_record, KEYS[11], ARGV[12], ARGV[15], ARGV[16], ARGV[17], ARGV[18], ARGV[19], ARGV[20])
end
return 1
