"""The limiter's two Lua scripts and the thin class that runs them (serving.gateway.limits says
what the limits are and when each phase runs).

Both scripts take the nine keys of `tenants.counter_keys` (one key's counters, its tenant's
counters and the tenant's stored limits), then the tenant's spend counters of the month
(serving.gateway.budgets); settle also takes the tenant's usage ledger of the day
(serving.gateway.usage_ledger). All carry the tenant's hash tag: one Redis Cluster slot. Time comes from Redis `TIME`,
so every gateway replica shares one clock. Times are integer microseconds (exact in a Lua
double up to 2^53); numbers are written with %.0f because Lua's tostring would use exponent
notation. redis-py's `Script` sends EVALSHA and falls back to EVAL once on NOSCRIPT (e.g. after
a Redis restart).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from serving.gateway.budgets import BUDGET_LUA, spend_expire_at, spend_key
from serving.gateway.metering import Usage
from serving.gateway.redis_client import GatedRedis, ScriptCall, run_together
from serving.gateway.tenants import counter_keys
from serving.gateway.usage_ledger import LEDGER_LUA, record_call

_PRELUDE = BUDGET_LUA + LEDGER_LUA + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local day = math.floor(tonumber(t[1]) / 86400)
local MINUTE = 60000000
local function num(x) return string.format('%.0f', x) end
-- TATs read or written so far by this script: every write goes through save_tat and the clock
-- stands still inside a script, so a second read of a key needs no second GET.
local tats = {}
local function tat_of(key)
  local tat = tats[key]
  if tat == nil then
    tat = tonumber(redis.call('GET', key) or now)
    if tat < now then tat = now end
    tats[key] = tat
  end
  return tat
end
local function save_tat(key, tat)
  if tat > now then redis.call('SET', key, num(tat), 'PX', num(math.ceil((tat - now) / 1000) + 1000))
  else redis.call('DEL', key) end
  tats[key] = math.max(tat, now)
end
-- Keep the refusal with the longest wait (-1: waiting cannot help, which beats any wait).
local function add_refusal(r, name, w)
  if not r.refused or w < 0 or (r.wait >= 0 and w > r.wait) then r.refused, r.wait = name, w end
end
"""

# ARGV: phase ('all' | 'slot' | 'tokens'); the key's rpm, tpm, daily budget, max concurrent;
# the tenant's default rpm, tpm, daily budget, max concurrent (0: no such limit; the tenant's own
# limits in KEYS[9] win); cost (tokens); slot id; slot ttl (s); concurrency wait (us); shadow (1/0);
# shadow max concurrent; whether the slot phase charged the key's request (for the tokens phase);
# then the monthly budget (KEYS[10]: the month's spend hash): key id, the reservation's cost in
# nano-USD (0: the model has no rate, so no budget applies), the key's budget, the tenant's default
# budget (nano-USD, 0: none; the tenant's own `monthly_budget_usd` in KEYS[9] wins), the spend
# hash's expiry and the start of the next month (epoch seconds).
#
# The shebang (Redis >= 7) makes Redis refuse the whole script up front, with an OOM error, when
# it is over maxmemory: without it Redis checks memory only at a script's first write command
# that needs memory, and lets everything through once the script has written at all (its
# ZREMRANGEBYSCORE counts), so a full Redis would still admit. Admission then fails closed
# (serving.gateway.limits). SETTLE_LUA has none: settling only records what was already served.
ADMIT_LUA = "#!lua\n" + _PRELUDE + """
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
"""

# ARGV: key tpm; tenant tpm (0: none); refund (reserved - billed; negative charges extra); slot id;
# admission day; key tokens charged (1/0); tokens phase ran (1/0); give the request back (1/0);
# key rpm; tenant rpm (0: none); key request charged (1/0); then the cost side: key id, spend delta
# in nano-USD (billed cost - reserved cost; KEYS[10] is the spend hash of the month the request
# was charged to), the spend hash's expiry, and the ledger entry (KEYS[11], the day's usage hash):
# model label, prompt and completion tokens billed, the hash's expiry. Empty strings: nothing to
# record.
SETTLE_LUA = _PRELUDE + """
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
if integer(ARGV[16]) and integer(ARGV[17]) and integer(ARGV[18]) then
  pcall(ledger_record, KEYS[11], ARGV[12], ARGV[15], ARGV[16], ARGV[17], ARGV[18])
end
return 1
"""


def no_limit_as_zero(value: int | None) -> int:
    return value or 0


class RedisLimiter:
    """Runs the scripts; one EVALSHA per call (an admit or a settle may carry another script in
    its round trip), its thirty-odd keys and arguments packed by hiredis in C as they are
    (serving.gateway.redis_client.packed_by_hiredis). The caller (limits.Limiter) builds the
    admission arguments, turns replies into decisions and Redis failures into its fail mode."""

    def __init__(self, redis_url: str) -> None:
        self._client = GatedRedis(redis_url)  # no retries: a retried EVALSHA could charge twice
        self._admit = self._client.redis.register_script(ADMIT_LUA)
        self._settle = self._client.redis.register_script(SETTLE_LUA)

    async def admit(self, ticket: Any, args: list[object], *, along: ScriptCall | None = None) -> list[Any]:
        """`along`: another script (the fair queue's try) sent in the same round trip; its reply
        stays in it."""
        who = ticket.who
        keys = [*counter_keys(who.tenant, who.key_id), spend_key(who.tenant, ticket.month)]
        reply: list[Any] = await self._run(self._admit, keys, args, along)
        return reply

    async def settle(self, ticket: Any, billed: Usage, *, give_back_request: bool,
                     along: ScriptCall | None = None) -> None:
        """End `ticket` (serving.gateway.limits.Ticket): refund what it reserved beyond `billed`
        and free its slot; `give_back_request` also returns its request to the rate limits. In
        the same script: the spend correction (billed cost - reserved cost) into the month the
        request was charged to, and the ledger entry of today (UTC). `along`: another script
        (the fair queue's release) sent in the same round trip; its reply stays in it."""
        who, limits, tenant = ticket.who, ticket.who.limits, ticket.tenant_limits
        args: list[object] = [
            limits.tokens_per_minute, no_limit_as_zero(tenant.tokens_per_minute), ticket.reserved - billed.total,
            ticket.slot_id, ticket.day, int(ticket.key_tokens_charged), int(ticket.tokens_phase_done),
            int(give_back_request), limits.requests_per_minute, no_limit_as_zero(tenant.requests_per_minute),
            int(ticket.key_request_charged)]
        ledger_keys, ledger_args = record_call(who.tenant, who.key_id, ticket.model, billed.prompt, billed.completion,
                                               datetime.now(UTC))
        if not ticket.tokens_phase_done:  # released after the slot phase: nothing charged, nothing used
            ledger_args, delta = ["", "", "", "", ""], 0
        else:
            delta = ticket.cost_of(billed.total) - ticket.reserved_nano_usd
        args += [who.key_id, str(delta), str(spend_expire_at(ticket.month)), *ledger_args[1:]]
        keys = [*counter_keys(who.tenant, who.key_id), spend_key(who.tenant, ticket.month), *ledger_keys]
        await self._run(self._settle, keys, args, along)

    async def _run(self, script: Any, keys: list[str], args: list[object], along: ScriptCall | None) -> Any:
        """One of our scripts, alone or with `along` in the same round trip; its reply, or its error raised."""
        async with self._client.slot() as redis:
            if along is None:
                return await script(keys=keys, args=args)
            call = ScriptCall(script, keys, args)
            await run_together(redis, [call, along])
        if isinstance(call.result, Exception):
            raise call.result
        return call.result

    async def aclose(self) -> None:
        await self._client.aclose()
