"""The limiter's two Lua scripts (limiter_admit.lua, limiter_settle.lua, after the shared
functions of budget.lua, usage_ledger.lua and limiter_prelude.lua) and the thin class that runs
them (serving.gateway.limits.limiter says what the limits are and when each phase runs).

Both scripts take the nine keys of `tenants.counter_keys` (one key's counters, its tenant's
counters and the tenant's stored limits), then the tenant's spend counters of the month
(serving.gateway.limits.budgets); settle also takes the tenant's usage ledger of the day
(serving.gateway.limits.usage_ledger). All carry the tenant's hash tag: one Redis Cluster slot.
Time comes from Redis `TIME`, so every gateway replica shares one clock. Times are integer microseconds (exact in a Lua
double up to 2^53); numbers are written with %.0f because Lua's tostring would use exponent
notation. redis-py's `Script` sends EVALSHA and falls back to EVAL once on NOSCRIPT (e.g. after
a Redis restart).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from serving.gateway.limits.budgets import spend_expire_at, spend_key
from serving.gateway.limits.tenants import counter_keys
from serving.gateway.limits.usage_ledger import record_call
from serving.gateway.metering.usage_meter import Usage
from serving.gateway.redis.client import GatedRedis, ScriptCall, run_together
from serving.gateway.redis.scripts import lua

_PRELUDE = lua("serving.gateway.limits", "budget.lua", "usage_ledger.lua", "limiter_prelude.lua")

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
# (serving.gateway.limits.limiter). SETTLE_LUA has none: settling only records what was already served.
ADMIT_LUA = "#!lua\n" + _PRELUDE + lua("serving.gateway.limits", "limiter_admit.lua")

# ARGV: key tpm; tenant tpm (0: none); refund (reserved - billed; negative charges extra); slot id;
# admission day; key tokens charged (1/0); tokens phase ran (1/0); give the request back (1/0);
# key rpm; tenant rpm (0: none); key request charged (1/0); then the cost side: key id, spend delta
# in nano-USD (billed cost - reserved cost; KEYS[10] is the spend hash of the month the request
# was charged to), the spend hash's expiry, and the ledger entry (KEYS[11], the day's usage hash):
# model label, prompt and completion tokens billed, the hash's expiry. Empty strings: nothing to
# record.
SETTLE_LUA = _PRELUDE + lua("serving.gateway.limits", "limiter_settle.lua")


def no_limit_as_zero(value: int | None) -> int:
    return value or 0


class RedisLimiter:
    """Runs the scripts; one EVALSHA per call (an admit or a settle may carry another script in
    its round trip), its thirty-odd keys and arguments packed by hiredis in C as they are
    (serving.gateway.redis.client.packed_by_hiredis). The caller (limits.Limiter) builds the
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
        """End `ticket` (serving.gateway.limits.limiter.Ticket): refund what it reserved beyond `billed`
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
