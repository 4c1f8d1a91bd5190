"""Per-key and per-tenant limits, enforced in Redis (serving.gateway.limits.redis_limiter).

Four limits per API key, and the same four shared by all keys of its tenant (a tenant with k
keys does not get k times its limits). Each applies where it is set; the key's always are.

- requests per minute: GCRA, weight 1, burst = one minute of capacity (a fresh key may send
  `requests_per_minute` requests at once, then one every 60/rpm seconds);
- tokens per minute: GCRA, weight = the tokens reserved at admission (see `reservation`);
- max concurrent requests: a sorted set of in-flight slots, each with an expiry (the request's
  total timeout plus `SLOT_TTL_MARGIN_S`) so a gateway that crashes mid-request cannot leak a slot;
- daily token budget: a counter for the current UTC day (expires after two days);
- monthly budget in dollars: the reservation's cost at the model's rate card, against what the
  key and its tenant spent this UTC calendar month (serving.gateway.limits.budgets). A key's budget is
  its record's `monthly_budget_usd`; a tenant's is its own (`llmctl tenants set`), else the
  gateway's default.

All limits of a request are checked together and charged together: all or nothing. Admission
has two phases so that cheap checks come before expensive work: `admit_slot` (requests per
minute and concurrency) before the gateway reads a large body, `admit_tokens` (token rate and
daily budget) once the body says what it reserves; a refusal in the second phase gives back
what the first took. `admit` runs both at once, for requests whose body is already read.
Settlement, when the response ends, refunds unused reserved tokens to the day the reservation
was charged to (carried on the ticket) and frees the slot; in the same script it corrects the
month's spend to the billed cost (the month is carried on the ticket too) and records the
request in the usage ledger (serving.gateway.limits.usage_ledger), shadow keys included.

Keys in shadow mode are served when over their own limits, uncharged on their own counters,
but they still hold concurrency slots, count against their tenant (whose limits are always
enforced), and are refused past `shadow_max_concurrent_requests` in flight.

When Redis is full (it refuses writes for memory: the stack runs it with `maxmemory-policy
noeviction`, so budgets are never evicted), admission refuses (503) in either fail mode: the local
limiter does not enforce monthly budgets, so falling back to it would forget them.

When Redis fails otherwise, `limiter_fail_mode` decides: `closed` refuses (503 + Retry-After); `local`
admits under `LocalLimiter`, the same limits in this process's memory, per replica (while
Redis is down the cluster-wide allowance becomes replicas x limit). Monthly budgets are not
enforced by the local limiter and the ledger records nothing while Redis is down: spend and
usage live in Redis only. A busy connection pool is load, not a failure: `LimiterBusy`,
answered 503 + Retry-After in either mode.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import anyio

from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.limits.budgets import cost_nano_usd, month_end_s, month_of, nano_usd, spend_expire_at
from serving.gateway.limits.local_limiter import LocalLimiter
from serving.gateway.limits.redis_limiter import RedisLimiter, no_limit_as_zero
from serving.gateway.metering.usage_meter import LimitDecision, Usage
from serving.gateway.redis.client import RedisBusy, ScriptCall, is_out_of_memory

log = logging.getLogger("llmstack.gateway.limits")

# A request's slot expires this long after its total timeout (settings.request_timeout_s),
# so a gateway that dies mid-request cannot hold a slot for longer than that.
SLOT_TTL_MARGIN_S = 30
# Concurrency has no exact wait: a slot frees when some in-flight response ends, which nobody
# can predict. One second is a short, honest "try again soon".
CONCURRENCY_RETRY_S = 1.0


class LimiterUnavailable(RuntimeError):
    """Redis failed and the fail mode is `closed`."""


class LimiterOutOfMemory(LimiterUnavailable):
    """Redis refused the limiter's write for memory: refused whatever the fail mode."""


class LimiterBusy(RuntimeError):
    """Every Redis connection is busy: load, answered 503 + Retry-After whatever the fail mode."""


@dataclass(frozen=True)
class Who:
    """The caller as the limiter sees it: a key, its tenant, the key's effective limits, the
    tenant's default limits (its stored ones win, in Redis), whether the key is in shadow mode and
    the key's monthly budget in dollars."""

    key_id: str
    tenant: str
    limits: KeyLimits
    tenant_defaults: TenantLimits
    shadow: bool = False
    shadow_max_concurrent: int = 64
    monthly_budget_usd: Decimal | None = None


@dataclass(frozen=True)
class Spend:
    """The month's spend as the admission saw it (after its own charge), in nano-USD, and the
    tenant's budget in force (0: none)."""

    key_nano_usd: int
    tenant_nano_usd: int
    tenant_budget_nano_usd: int


def effective_limits(record: object, defaults: KeyLimits) -> KeyLimits:
    """The key's own limits where it has them, the gateway's defaults elsewhere."""
    overrides = {name: getattr(record, name) for name in KeyLimits.model_fields if getattr(record, name) is not None}
    return defaults.model_copy(update=overrides)


@dataclass
class Ticket:
    """One request's admission: its decision and what it charged. When allowed, `settle` it
    exactly once when the response ends, or `release` it if the request ends before it reached
    the upstream."""

    who: Who
    decision: LimitDecision | None = None
    reserved: int = 0
    slot_id: str = field(default_factory=lambda: secrets.token_hex(16))  # 128 random bits, like a uuid4
    day: int = -1  # the UTC day (Redis's clock) the tokens were charged to
    key_request_charged: bool = False
    key_tokens_charged: bool = False
    tokens_phase_done: bool = False
    tenant_limits: TenantLimits = field(default_factory=TenantLimits)  # effective at admission
    model: str = ""  # the metrics label of the model: the usage ledger's field
    usd_per_million_tokens: Decimal | None = None  # the model's rate card; None: no cost, no budget
    month: str = field(default_factory=lambda: month_of(datetime.now(UTC)))  # charged to
    reserved_nano_usd: int = 0  # the reservation's cost, charged to `month` at admission
    spend: Spend | None = None  # seen at admission (Redis only), for the budget-used gauge
    backend: RedisLimiter | LocalLimiter | None = None
    settled: bool = False
    on_error: Callable[[], None] | None = None  # told when settling in Redis fails

    @property
    def allowed(self) -> bool:
        return self.decision is not None and self.decision.allowed

    @property
    def local_fallback(self) -> bool:
        """Admitted by this process's own limits because Redis failed."""
        return isinstance(self.backend, LocalLimiter) and self.on_error is not None

    def cost_of(self, tokens: int) -> int:
        """`tokens` at the ticket's rate, in nano-USD (0 without a rate)."""
        rate = self.usd_per_million_tokens
        return 0 if rate is None or rate <= 0 else cost_nano_usd(tokens, rate)

    async def settle(self, billed: Usage, *, along: ScriptCall | None = None) -> None:
        """`along`: a script to send in the same Redis round trip when Redis settles this ticket
        (the fair queue's release); left unsent otherwise, for its owner to run alone."""
        await self._end(billed, give_back_request=False, along=along)

    async def release(self) -> None:
        """The request ended before the upstream saw it (a refusal after the slot phase, a
        client gone while sending its body): free the slot and give back everything charged."""
        await self._end(Usage(0, 0), give_back_request=True)

    async def _end(self, billed: Usage, *, give_back_request: bool, along: ScriptCall | None = None) -> None:
        if self.settled or not self.allowed or self.backend is None:
            return
        self.settled = True
        with anyio.CancelScope(shield=True):  # runs on disconnect too, when our task is being cancelled
            try:
                if along is not None and isinstance(self.backend, RedisLimiter):
                    await self.backend.settle(self, billed, give_back_request=give_back_request, along=along)
                else:
                    await self.backend.settle(self, billed, give_back_request=give_back_request)
            except Exception as exc:  # noqa: BLE001 - the slot then frees itself when its expiry passes
                log.warning("could not settle usage for key %s: %s", self.who.key_id, type(exc).__name__)
                if self.on_error is not None:
                    self.on_error()


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _decision(limits: KeyLimits, reply: list[Any]) -> tuple[LimitDecision, dict[str, Any]]:
    (allowed, refused, scope, rem_req, reset_req, rem_tok, reset_tok, wait, day, key_charged,
     t_rpm, t_tpm, t_daily, t_conc, key_spent, tenant_spent, tenant_budget) = reply
    wait_us = float(wait)
    decision = LimitDecision(
        allowed=bool(int(allowed)), refused=_text(refused) or None, scope=_text(scope) or None,
        limit_requests=limits.requests_per_minute, remaining_requests=int(rem_req),
        reset_requests_s=float(reset_req) / 1e6,
        limit_tokens=limits.tokens_per_minute, remaining_tokens=int(rem_tok), reset_tokens_s=float(reset_tok) / 1e6,
        retry_after_s=None if wait_us < 0 else wait_us / 1e6)
    counts = ("requests_per_minute", "tokens_per_minute", "daily_token_budget", "max_concurrent_requests")
    # The tenant's budget in force travels in `spend`: only Redis enforces budgets.
    tenant = TenantLimits(**{name: int(v) for name, v in zip(counts, (t_rpm, t_tpm, t_daily, t_conc)) if int(v) > 0})
    spend = Spend(int(key_spent), int(tenant_spent), int(tenant_budget))  # int() reads bytes, str and int alike
    return decision, {"day": int(day), "key_charged": bool(int(key_charged)), "tenant_limits": tenant,
                      "spend": spend}


class Limiter:
    """Redis when configured, with the fail mode deciding what happens when it errors."""

    def __init__(self, redis_url: str | None, fail_mode: str, *, request_timeout_s: float,
                 on_redis_error: Callable[[], None]) -> None:
        self._slot_ttl_s = math.ceil(request_timeout_s) + SLOT_TTL_MARGIN_S
        self._redis = RedisLimiter(redis_url) if redis_url else None
        self._local = LocalLimiter(self._slot_ttl_s)
        self._fail_mode = fail_mode
        self._on_redis_error = on_redis_error
        # Tenants' own limits as Redis last said them, so the local fallback keeps applying them.
        self._tenant_limits: dict[str, TenantLimits] = {}

    async def admit(self, who: Who, cost: int, *, model: str = "", usd_per_million_tokens: Decimal | None = None,
                    along: ScriptCall | None = None) -> Ticket:
        """Every limit at once: the request's body is read and its reservation known. `model`
        is the ledger's model label, `usd_per_million_tokens` its rate card (None: free).
        `along`: a script to send in the same Redis round trip (the fair queue's try for a free
        slot), whatever the verdict; left unsent (`sent` False) when Redis does not decide."""
        ticket = Ticket(who=who)
        _price(ticket, cost, model, usd_per_million_tokens)
        await self._run(ticket, "all", along)
        return ticket

    async def admit_slot(self, who: Who) -> Ticket:
        """Requests per minute and concurrency only, before the body is read."""
        ticket = Ticket(who=who)
        await self._run(ticket, "slot")
        return ticket

    async def admit_tokens(self, ticket: Ticket, cost: int, *, model: str = "",
                           usd_per_million_tokens: Decimal | None = None, along: ScriptCall | None = None) -> None:
        """Token rate, daily and monthly budgets for a ticket `admit_slot` allowed. A refusal
        here gives back what the slot phase took (the ticket's decision then says why).
        `along`: as for `admit`."""
        _price(ticket, cost, model, usd_per_million_tokens)
        await self._run(ticket, "tokens", along)

    async def _run(self, ticket: Ticket, phase: str, along: ScriptCall | None = None) -> None:
        if self._redis is not None and not isinstance(ticket.backend, LocalLimiter):
            from redis.exceptions import RedisError

            ticket.on_error = self._on_redis_error
            try:
                reply = await self._redis.admit(ticket, self._args(ticket, phase), along=along)
            except RedisBusy as exc:
                if phase == "tokens":
                    await ticket.release()
                raise LimiterBusy(str(exc)) from None
            except (RedisError, OSError, TimeoutError) as exc:
                self._on_redis_error()
                if is_out_of_memory(exc):
                    log.error("limiter Redis is out of memory: refusing requests until it has room")
                    if phase == "tokens":
                        await ticket.release()
                    raise LimiterOutOfMemory(type(exc).__name__) from exc
                log.warning("limiter Redis failed (%s); fail mode %s", type(exc).__name__, self._fail_mode)
                if self._fail_mode == "closed":
                    raise LimiterUnavailable(type(exc).__name__) from exc
                phase = "all" if phase == "tokens" else phase  # the local limiter never saw the slot phase
            else:
                decision, extra = _decision(ticket.who.limits, reply)
                self._tenant_limits[ticket.who.tenant] = extra["tenant_limits"]
                self._apply(ticket, phase, decision, extra["day"], extra["key_charged"], extra["tenant_limits"])
                if phase != "slot":
                    ticket.spend = extra["spend"]
                ticket.backend = self._redis
                return
        tenant_limits = self._tenant_limits.get(ticket.who.tenant, ticket.who.tenant_defaults)
        ticket.reserved_nano_usd = 0  # budgets live in Redis: none charged (nor enforced) locally
        decision, day, key_charged = self._local.admit(ticket, phase, tenant_limits, CONCURRENCY_RETRY_S)
        self._apply(ticket, phase, decision, day, key_charged, tenant_limits)
        ticket.backend = self._local

    @staticmethod
    def _apply(ticket: Ticket, phase: str, decision: LimitDecision, day: int, key_charged: bool,
               tenant_limits: TenantLimits) -> None:
        ticket.decision = decision
        ticket.tenant_limits = tenant_limits
        if not decision.allowed:
            return
        if phase in ("all", "slot"):
            ticket.key_request_charged = key_charged
        if phase in ("all", "tokens"):
            ticket.key_tokens_charged = key_charged
            ticket.tokens_phase_done = True
            ticket.day = day

    def _args(self, ticket: Ticket, phase: str) -> list[object]:
        who, defaults = ticket.who, ticket.who.tenant_defaults
        return [phase, who.limits.requests_per_minute, who.limits.tokens_per_minute, who.limits.daily_token_budget,
                who.limits.max_concurrent_requests, no_limit_as_zero(defaults.requests_per_minute),
                no_limit_as_zero(defaults.tokens_per_minute), no_limit_as_zero(defaults.daily_token_budget),
                no_limit_as_zero(defaults.max_concurrent_requests), ticket.reserved, ticket.slot_id, self._slot_ttl_s,
                int(CONCURRENCY_RETRY_S * 1e6), int(who.shadow), who.shadow_max_concurrent,
                int(ticket.key_request_charged),
                who.key_id, str(ticket.reserved_nano_usd), str(_budget_nano(who.monthly_budget_usd)),
                str(_budget_nano(defaults.monthly_budget_usd)), spend_expire_at(ticket.month),
                month_end_s(ticket.month)]

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


def _budget_nano(usd: Decimal | None) -> int:
    return 0 if usd is None else nano_usd(usd)


def _price(ticket: Ticket, tokens: int, model: str, usd_per_million_tokens: Decimal | None) -> None:
    """What the ticket reserves, in tokens and in nano-USD at the model's rate, charged to the
    current UTC month."""
    ticket.reserved, ticket.model, ticket.usd_per_million_tokens = tokens, model, usd_per_million_tokens
    ticket.month = month_of(datetime.now(UTC))
    ticket.reserved_nano_usd = ticket.cost_of(tokens)

