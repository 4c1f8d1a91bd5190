local phase = ARGV[1]
local slots_phase, tokens_phase = phase ~= 'tokens', phase ~= 'slot'
local key_lim = {rpm = tonumber(ARGV[2]), tpm = tonumber(ARGV[3]), daily = tonumber(ARGV[4]),
                 conc = tonumber(ARGV[5])}
local own = redis.call('HMGET', KEYS[9], 'requests_per_minute', 'tokens_per_minute', 'daily_token_budget',
                       'max_concurrent_requests', 'monthly_budget_usd')
local function pick(i, default) return tonumber(own[i]) or tonumber(default) end
local ten_lim = {rpm = pick(1, ARGV[6]), tpm = pick(2, ARGV[7]), daily = pick(3, ARGV[8]), conc = pick(4, ARGV[9])}
local cost, slot_id, ttl, conc_wait = tonumber(ARGV[10]), ARGV[11], tonumber(ARGV[12]), tonumber(ARGV[13])
local shadow, shadow_max, key_request_charged = ARGV[14] == '1', tonumber(ARGV[15]), ARGV[16] == '1'
local key_id, cost_usd, key_budget = ARGV[17], tonumber(ARGV[18]), tonumber(ARGV[19])
local ten_budget = usd_to_nano(own[5])
if ten_budget == 0 then ten_budget = tonumber(ARGV[20]) end

-- What admitting would do to one scope's counters (KEYS[base..base+3]), and the refusal with
-- the longest wait (-1: waiting cannot help, which beats any wait).
local function check(base, lim)
  local r = {refused = false, wait = 0}
  local function refuse(name, w) add_refusal(r, name, w) end
  if slots_phase then
    if lim.rpm > 0 then
      r.new_req = tat_of(KEYS[base]) + MINUTE / lim.rpm
      -- GCRA: admit when the new theoretical arrival time is within one minute (the burst) of now.
      if r.new_req - MINUTE > now then refuse('requests', r.new_req - MINUTE - now) end
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[base + 2], '-inf', now)
    -- The key's count also bounds a shadow key's requests; a tenant's only its own limit.
    if base == 1 or lim.conc > 0 then
      r.in_flight = redis.call('ZCARD', KEYS[base + 2])
      if lim.conc > 0 and r.in_flight >= lim.conc then refuse('concurrency', conc_wait) end
    end
  end
  if tokens_phase then
    if lim.tpm > 0 then
      r.new_tok = tat_of(KEYS[base + 1]) + cost * (MINUTE / lim.tpm)
      if cost > lim.tpm then refuse('tokens', -1)
      elseif r.new_tok - MINUTE > now then refuse('tokens', r.new_tok - MINUTE - now) end
    end
    local daily = redis.call('HMGET', KEYS[base + 3], 'day', 'used')
    r.used, r.day_started = 0, tonumber(daily[1]) ~= day
    if not r.day_started then r.used = tonumber(daily[2]) or 0 end
    if lim.daily > 0 then
      if cost > lim.daily then refuse('daily_tokens', -1)
      elseif r.used + cost > lim.daily then refuse('daily_tokens', (day + 1) * 86400 * 1000000 - now) end
    end
  end
  return r
end

local function charge(base, r, counters)
  if slots_phase then
    if counters and r.new_req then save_tat(KEYS[base], r.new_req) end
    redis.call('ZADD', KEYS[base + 2], num(now + ttl * 1000000), slot_id)
    redis.call('EXPIRE', KEYS[base + 2], ttl)
  end
  if tokens_phase and counters then
    if r.new_tok then save_tat(KEYS[base + 1], r.new_tok) end
    redis.call('HSET', KEYS[base + 3], 'day', day, 'used', num(r.used + cost))
    -- Set when the day's count starts: the hash then outlives its day by at least one more
    -- (for settlements of requests admitted that day), and needs no EXPIRE per request.
    if r.day_started then redis.call('EXPIRE', KEYS[base + 3], 2 * 86400) end
  end
end

local k, ten = check(1, key_lim), check(5, ten_lim)
-- Monthly budgets in dollars: spent this month plus the reservation's cost must fit. A model
-- without a rate costs nothing, so no budget stops it.
local spent = {key = 0, tenant = 0}
if tokens_phase then
  local b = budget_check(KEYS[10], key_id, ARGV[18], ARGV[19], num(ten_budget))
  spent.key, spent.tenant = tonumber(b[2]), tonumber(b[3])
  if cost_usd > 0 then
    local month_wait = math.max(tonumber(ARGV[22]) * 1000000 - now, 1000000)
    for _, scope in ipairs({{k, spent.key, key_budget}, {ten, spent.tenant, ten_budget}}) do
      local r, used, budget = scope[1], scope[2], scope[3]
      if budget > 0 then
        if cost_usd > budget then add_refusal(r, 'monthly_budget', -1)
        elseif used + cost_usd > budget then add_refusal(r, 'monthly_budget', month_wait) end
      end
    end
  end
end
local allowed, refused, scope, wait, key_charged = 1, '', '', 0, 1
if ten.refused then
  allowed, refused, scope, wait = 0, ten.refused, 'tenant', ten.wait
elseif k.refused and not shadow then
  allowed, refused, scope, wait = 0, k.refused, 'key', k.wait
elseif k.refused then
  -- Shadow mode: served, the key's own counters untouched, but its requests still hold slots
  -- and their number stays bounded.
  refused, scope, wait, key_charged = k.refused, 'shadow', k.wait, 0
  if slots_phase and k.in_flight >= shadow_max then allowed, refused, wait = 0, 'concurrency', conc_wait end
end
if allowed == 1 then
  charge(1, k, key_charged == 1)
  charge(5, ten, true)
  if tokens_phase and cost_usd > 0 then
    -- Spend is money, not a limit: a shadow key's is charged too, like its ledger.
    budget_charge(KEYS[10], key_id, ARGV[18], ARGV[21])
    spent.key, spent.tenant = spent.key + cost_usd, spent.tenant + cost_usd
  end
elseif phase == 'tokens' then
  -- All or nothing: give back what the slot phase took.
  redis.call('ZREM', KEYS[3], slot_id)
  redis.call('ZREM', KEYS[7], slot_id)
  if key_request_charged then save_tat(KEYS[1], tat_of(KEYS[1]) - MINUTE / key_lim.rpm) end
  if ten_lim.rpm > 0 then save_tat(KEYS[5], tat_of(KEYS[5]) - MINUTE / ten_lim.rpm) end
end
local req_tat, tok_tat = tat_of(KEYS[1]), tat_of(KEYS[2])
return {allowed, refused, scope,
        math.floor((now + MINUTE - req_tat) / (MINUTE / key_lim.rpm)), num(req_tat - now),
        math.floor((now + MINUTE - tok_tat) / (MINUTE / key_lim.tpm)), num(tok_tat - now),
        num(wait), day, key_charged, ten_lim.rpm, ten_lim.tpm, ten_lim.daily, ten_lim.conc,
        num(spent.key), num(spent.tenant), num(ten_budget)}
