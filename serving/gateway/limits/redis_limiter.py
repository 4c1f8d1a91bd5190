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

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any, ClassVar

from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.limits.budgets import month_end_s, nano_usd, spend_expire_at, spend_key
from serving.gateway.limits.decision import LimitDecision
from serving.gateway.limits.tenants import counter_keys
from serving.gateway.limits.ticket import Phase, PhaseResult, Spend, Ticket
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
# model label, prompt and completion tokens billed, the hash's expiry, the resumed stream's re-done
# prompt and completion tokens (the platform's overhead). Empty strings: nothing to record.
SETTLE_LUA = _PRELUDE + lua("serving.gateway.limits", "limiter_settle.lua")


def no_limit_as_zero(value: int | None) -> int:
    return value or 0


def _budget_nano(usd: Decimal | None) -> int:
    return 0 if usd is None else nano_usd(usd)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class AdmitReply:
    """limiter_admit.lua's reply, field by field in the order the script returns them. Times are
    microseconds of Redis's clock; a wait of -1 means waiting cannot help."""

    allowed: bool
    refused: str  # '' when allowed
    scope: str  # '' when allowed; 'key' | 'tenant' | 'shadow'
    remaining_requests: int
    reset_requests_us: float
    remaining_tokens: int
    reset_tokens_us: float
    wait_us: float
    day: int
    key_charged: bool
    tenant_rpm: int  # the tenant's limits in force (0: none)
    tenant_tpm: int
    tenant_daily: int
    tenant_concurrent: int
    key_spent_nano_usd: int
    tenant_spent_nano_usd: int
    tenant_budget_nano_usd: int

    @classmethod
    def parse(cls, reply: list[Any]) -> AdmitReply:
        """The script's array (bytes, str or int items, as redis-py hands them) as typed fields."""
        return cls(*(convert(raw) for convert, raw in zip(_READERS, reply, strict=True)))

    def decision(self, limits: KeyLimits) -> LimitDecision:
        return LimitDecision(
            allowed=self.allowed,
            refused=self.refused or None,
            scope=self.scope or None,
            limit_requests=limits.requests_per_minute,
            remaining_requests=self.remaining_requests,
            reset_requests_s=self.reset_requests_us / 1e6,
            limit_tokens=limits.tokens_per_minute,
            remaining_tokens=self.remaining_tokens,
            reset_tokens_s=self.reset_tokens_us / 1e6,
            retry_after_s=None if self.wait_us < 0 else self.wait_us / 1e6,
        )

    def tenant_limits(self) -> TenantLimits:
        """The tenant's limits in force (its own in Redis, else the gateway's defaults). Its budget
        in force travels in `spend`: only Redis enforces budgets."""
        counts = {
            "requests_per_minute": self.tenant_rpm,
            "tokens_per_minute": self.tenant_tpm,
            "daily_token_budget": self.tenant_daily,
            "max_concurrent_requests": self.tenant_concurrent,
        }
        return TenantLimits(**{name: value for name, value in counts.items() if value > 0})

    def spend(self) -> Spend:
        return Spend(self.key_spent_nano_usd, self.tenant_spent_nano_usd, self.tenant_budget_nano_usd)


def _flag(raw: bytes | str | int) -> bool:
    return bool(int(raw))


# How each AdmitReply field is read from the script's reply; int() reads bytes, str and int alike.
_READ_BY_TYPE: dict[str, Callable[[Any], Any]] = {"bool": _flag, "str": _text, "float": float, "int": int}
_READERS = tuple(_READ_BY_TYPE[str(spec.type)] for spec in fields(AdmitReply))


class RedisLimiter:
    """Runs the scripts; one EVALSHA per call (an admit or a settle may carry another script in
    its round trip), its thirty-odd keys and arguments packed by hiredis in C as they are
    (serving.gateway.redis.client.packed_by_hiredis). The caller (limits.Limiter) turns Redis
    failures into its fail mode."""

    shared: ClassVar[bool] = True

    def __init__(self, redis_url: str, slot_ttl_s: int, concurrency_wait_s: float) -> None:
        self._client = GatedRedis(redis_url)  # no retries: a retried EVALSHA could charge twice
        self._admit = self._client.redis.register_script(ADMIT_LUA)
        self._settle = self._client.redis.register_script(SETTLE_LUA)
        self._slot_ttl_s = slot_ttl_s
        self._concurrency_wait_us = int(concurrency_wait_s * 1e6)

    async def admit(
        self, ticket: Ticket, phase: Phase, tenant_limits: TenantLimits, *, along: ScriptCall | None = None
    ) -> PhaseResult:
        """`tenant_limits`: unused, the script reads the tenant's own. `along`: another script
        (the fair queue's try) sent in the same round trip; its reply stays in it."""
        who = ticket.who
        keys = [*counter_keys(who.tenant, who.key_id), spend_key(who.tenant, ticket.month)]
        reply = AdmitReply.parse(await self._run(self._admit, keys, self._admit_args(ticket, phase), along))
        return PhaseResult(
            reply.decision(who.limits), reply.day, reply.key_charged, reply.tenant_limits(), reply.spend()
        )

    def _admit_args(self, ticket: Ticket, phase: Phase) -> list[object]:
        """ARGV of limiter_admit.lua, in the order its header comment lists them."""
        who, defaults = ticket.who, ticket.who.tenant_defaults
        return [
            phase.value,
            who.limits.requests_per_minute,
            who.limits.tokens_per_minute,
            who.limits.daily_token_budget,
            who.limits.max_concurrent_requests,
            no_limit_as_zero(defaults.requests_per_minute),
            no_limit_as_zero(defaults.tokens_per_minute),
            no_limit_as_zero(defaults.daily_token_budget),
            no_limit_as_zero(defaults.max_concurrent_requests),
            ticket.reserved,
            ticket.slot_id,
            self._slot_ttl_s,
            self._concurrency_wait_us,
            int(who.shadow),
            who.shadow_max_concurrent,
            int(ticket.key_request_charged),
            who.key_id,
            str(ticket.reserved_nano_usd),
            str(_budget_nano(who.monthly_budget_usd)),
            str(_budget_nano(defaults.monthly_budget_usd)),
            spend_expire_at(ticket.month),
            month_end_s(ticket.month),
        ]

    async def settle(
        self, ticket: Ticket, billed: Usage, *, give_back_request: bool, along: ScriptCall | None = None
    ) -> None:
        """End `ticket` (serving.gateway.limits.limiter.Ticket): refund what it reserved beyond `billed`
        and free its slot; `give_back_request` also returns its request to the rate limits. In
        the same script: the spend correction (billed cost - reserved cost) into the month the
        request was charged to, and the ledger entry of today (UTC). `along`: another script
        (the fair queue's release) sent in the same round trip; its reply stays in it."""
        who, limits, tenant = ticket.who, ticket.who.limits, ticket.tenant_limits
        args: list[object] = [
            limits.tokens_per_minute,
            no_limit_as_zero(tenant.tokens_per_minute),
            ticket.reserved - billed.total,
            ticket.slot_id,
            ticket.day,
            int(ticket.key_tokens_charged),
            int(ticket.tokens_phase_done),
            int(give_back_request),
            limits.requests_per_minute,
            no_limit_as_zero(tenant.requests_per_minute),
            int(ticket.key_request_charged),
        ]
        ledger_keys, ledger_args = record_call(
            who.tenant,
            who.key_id,
            ticket.model,
            billed.prompt,
            billed.completion,
            datetime.now(UTC),
            overhead=(billed.overhead_prompt, billed.overhead_completion),
        )
        if not ticket.tokens_phase_done:  # released after the slot phase: nothing charged, nothing used
            ledger_args, delta = [""] * len(ledger_args), 0
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
