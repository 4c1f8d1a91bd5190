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

When Redis fails otherwise, `limiter_fail_mode` decides: `closed` refuses (503 + Retry-After);
`local` admits under `LocalLimiter` (serving.gateway.limits.local_limiter), the same limits in
this process's memory, per replica (while Redis is down the cluster-wide allowance becomes
replicas x limit). Monthly budgets are not enforced by the local limiter and the ledger records
nothing while Redis is down: spend and usage live in Redis only. A busy connection pool is load,
not a failure: `LimiterBusy`, answered 503 + Retry-After in either mode.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal

from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.limits.budgets import month_of
from serving.gateway.limits.local_limiter import LocalLimiter
from serving.gateway.limits.redis_limiter import RedisLimiter
from serving.gateway.limits.ticket import Phase, Ticket, Who
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


def effective_limits(record: object, defaults: KeyLimits) -> KeyLimits:
    """The key's own limits where it has them, the gateway's defaults elsewhere."""
    overrides = {name: getattr(record, name) for name in KeyLimits.model_fields if getattr(record, name) is not None}
    return defaults.model_copy(update=overrides)


class Limiter:
    """Redis when configured, with the fail mode deciding what happens when it errors."""

    def __init__(
        self, redis_url: str | None, fail_mode: str, *, request_timeout_s: float, on_redis_error: Callable[[], None]
    ) -> None:
        slot_ttl_s = math.ceil(request_timeout_s) + SLOT_TTL_MARGIN_S
        self._redis = RedisLimiter(redis_url, slot_ttl_s, CONCURRENCY_RETRY_S) if redis_url else None
        self._local = LocalLimiter(slot_ttl_s, CONCURRENCY_RETRY_S)
        self._fail_mode = fail_mode
        self._on_redis_error = on_redis_error
        # Tenants' own limits as Redis last said them, so the local fallback keeps applying them.
        self._tenant_limits: dict[str, TenantLimits] = {}

    async def admit(
        self,
        who: Who,
        cost: int,
        *,
        model: str = "",
        usd_per_million_tokens: Decimal | None = None,
        along: ScriptCall | None = None,
    ) -> Ticket:
        """Every limit at once: the request's body is read and its reservation known. `model`
        is the ledger's model label, `usd_per_million_tokens` its rate card (None: free).
        `along`: a script to send in the same Redis round trip (the fair queue's try for a free
        slot), whatever the verdict; left unsent (`sent` False) when Redis does not decide."""
        ticket = Ticket(who=who)
        _price(ticket, cost, model, usd_per_million_tokens)
        await self._run(ticket, Phase.ALL, along)
        return ticket

    async def admit_slot(self, who: Who) -> Ticket:
        """Requests per minute and concurrency only, before the body is read."""
        ticket = Ticket(who=who)
        await self._run(ticket, Phase.SLOT)
        return ticket

    async def admit_tokens(
        self,
        ticket: Ticket,
        cost: int,
        *,
        model: str = "",
        usd_per_million_tokens: Decimal | None = None,
        along: ScriptCall | None = None,
    ) -> None:
        """Token rate, daily and monthly budgets for a ticket `admit_slot` allowed. A refusal
        here gives back what the slot phase took (the ticket's decision then says why).
        `along`: as for `admit`."""
        _price(ticket, cost, model, usd_per_million_tokens)
        await self._run(ticket, Phase.TOKENS, along)

    async def _run(self, ticket: Ticket, phase: Phase, along: ScriptCall | None = None) -> None:
        if self._redis is not None and ticket.backend is not self._local:
            from redis.exceptions import RedisError

            ticket.on_error = self._on_redis_error
            try:
                result = await self._redis.admit(ticket, phase, ticket.who.tenant_defaults, along=along)
            except RedisBusy as exc:
                if phase is Phase.TOKENS:
                    await ticket.release()
                raise LimiterBusy(str(exc)) from None
            except (RedisError, OSError, TimeoutError) as exc:
                self._on_redis_error()
                if is_out_of_memory(exc):
                    log.error("limiter Redis is out of memory: refusing requests until it has room")
                    if phase is Phase.TOKENS:
                        await ticket.release()
                    raise LimiterOutOfMemory(type(exc).__name__) from exc
                log.warning("limiter Redis failed (%s); fail mode %s", type(exc).__name__, self._fail_mode)
                if self._fail_mode == "closed":
                    raise LimiterUnavailable(type(exc).__name__) from exc
                phase = Phase.ALL if phase is Phase.TOKENS else phase  # the local limiter never saw the slot phase
            else:
                self._tenant_limits[ticket.who.tenant] = result.tenant_limits
                ticket.apply(phase, result)
                if phase is not Phase.SLOT:
                    ticket.spend = result.spend
                ticket.backend = self._redis
                return
        tenant_limits = self._tenant_limits.get(ticket.who.tenant, ticket.who.tenant_defaults)
        ticket.reserved_nano_usd = 0  # budgets live in Redis: none charged (nor enforced) locally
        ticket.apply(phase, await self._local.admit(ticket, phase, tenant_limits))
        ticket.backend = self._local

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()


def _price(ticket: Ticket, tokens: int, model: str, usd_per_million_tokens: Decimal | None) -> None:
    """What the ticket reserves, in tokens and in nano-USD at the model's rate, charged to the
    current UTC month."""
    ticket.reserved, ticket.model, ticket.usd_per_million_tokens = tokens, model, usd_per_million_tokens
    ticket.month = month_of(datetime.now(UTC))
    ticket.reserved_nano_usd = ticket.cost_of(tokens)
