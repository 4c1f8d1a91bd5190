"""One table of limiter cases, run against both implementations of the limiter interface: the
Redis one (limiter_admit.lua and limiter_settle.lua in a real redis-server) and the local one
(this process's memory, the fallback while Redis is down). The two must agree on every rule they
share; budgets in dollars and the usage ledger are Redis's alone and are tested on their own.

Each step admits, settles or releases through the same `Limiter` facade the gateway uses; limits
are per minute or per day, so nothing here depends on how fast the steps run.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import pytest

from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.limits.limiter import Limiter
from serving.gateway.limits.ticket import Ticket, Who
from serving.gateway.metering.usage_meter import Usage

_names = itertools.count()


@dataclass(frozen=True)
class Step:
    """`admit` (both phases), `slot` or `tokens` (the two phases apart), `settle` or `release` of
    the ticket `ticket` names; what the decision must say (refused: None when allowed)."""

    action: str
    key: str = "a"
    cost: int = 10
    ticket: int = -1  # which earlier admission to settle, release or finish (index in the case's tickets)
    billed: int = 0
    allowed: bool = True
    refused: str | None = None
    scope: str | None = None
    can_wait: bool = True  # a refusal says when to retry (False: the request can never fit)


@dataclass(frozen=True)
class Case:
    key_limits: KeyLimits
    steps: list[Step]
    tenant_defaults: TenantLimits = field(default_factory=TenantLimits)
    shadow: bool = False


BIG = dict(
    requests_per_minute=1_000, tokens_per_minute=1_000_000, daily_token_budget=100_000_000, max_concurrent_requests=100
)

CASES = {
    "requests per minute, burst of the whole minute": Case(
        KeyLimits(**{**BIG, "requests_per_minute": 2}),
        [Step("admit"), Step("admit"), Step("admit", allowed=False, refused="requests", scope="key")],
    ),
    "a released request is given back": Case(
        KeyLimits(**{**BIG, "requests_per_minute": 1}),
        [
            Step("admit"),
            Step("release", ticket=0),
            Step("admit"),
            Step("admit", allowed=False, refused="requests", scope="key"),
        ],
    ),
    "tokens per minute, weighted by the reservation": Case(
        KeyLimits(**{**BIG, "tokens_per_minute": 100}),
        [Step("admit", cost=60), Step("admit", cost=60, allowed=False, refused="tokens", scope="key")],
    ),
    "unused tokens are refunded at settlement": Case(
        KeyLimits(**{**BIG, "tokens_per_minute": 100}),
        [Step("admit", cost=60), Step("settle", ticket=0, billed=10), Step("admit", cost=60)],
    ),
    "more than a whole minute of tokens never fits": Case(
        KeyLimits(**{**BIG, "tokens_per_minute": 100}),
        [Step("admit", cost=101, allowed=False, refused="tokens", scope="key", can_wait=False)],
    ),
    "concurrency frees at settlement": Case(
        KeyLimits(**{**BIG, "max_concurrent_requests": 1}),
        [
            Step("admit"),
            Step("admit", allowed=False, refused="concurrency", scope="key"),
            Step("settle", ticket=0, billed=5),
            Step("admit"),
        ],
    ),
    "daily budget, refunded to the day charged": Case(
        KeyLimits(**{**BIG, "daily_token_budget": 100}),
        [
            Step("admit", cost=60),
            Step("admit", cost=60, allowed=False, refused="daily_tokens", scope="key"),
            Step("settle", ticket=0, billed=10),
            Step("admit", cost=60),
        ],
    ),
    "more than a day's budget never fits": Case(
        KeyLimits(**{**BIG, "daily_token_budget": 100}),
        [Step("admit", cost=101, allowed=False, refused="daily_tokens", scope="key", can_wait=False)],
    ),
    "a tenant's limits are shared by its keys": Case(
        KeyLimits(**BIG),
        [Step("admit", key="a"), Step("admit", key="b", allowed=False, refused="requests", scope="tenant")],
        tenant_defaults=TenantLimits(requests_per_minute=1),
    ),
    "a shadow key over its limit is served, and says so": Case(
        KeyLimits(**{**BIG, "requests_per_minute": 1}),
        [Step("admit"), Step("admit", allowed=True, refused="requests", scope="shadow")],
        shadow=True,
    ),
    "a token refusal gives back the slot phase": Case(
        KeyLimits(**{**BIG, "max_concurrent_requests": 1, "tokens_per_minute": 100}),
        [
            Step("slot"),
            Step("tokens", ticket=0, cost=101, allowed=False, refused="tokens", scope="key", can_wait=False),
            Step("slot"),
            Step("tokens", ticket=2, cost=50),
        ],
    ),
}


@pytest.fixture(params=["redis", "local"])
def limiter(request):
    url = request.getfixturevalue("redis_server").url if request.param == "redis" else None
    mode = "closed" if url else "local"
    made = Limiter(url, mode, request_timeout_s=60, on_redis_error=lambda: pytest.fail("Redis failed"))
    yield made
    asyncio.run(made.aclose())


@pytest.mark.parametrize("name", list(CASES))
def test_both_limiters_agree(limiter, name):
    case = CASES[name]
    tenant = f"cases-{next(_names)}"  # the Redis server outlives one case: each gets fresh counters

    def who(key: str) -> Who:
        return Who(
            key_id=f"{tenant}-{key}",
            tenant=tenant,
            limits=case.key_limits,
            tenant_defaults=case.tenant_defaults,
            shadow=case.shadow,
            shadow_max_concurrent=8,
        )

    async def run() -> None:
        tickets: list[Ticket] = []
        for number, step in enumerate(case.steps):
            if step.action in ("settle", "release"):
                ticket = tickets[step.ticket]
                await (ticket.settle(Usage(step.billed, 0)) if step.action == "settle" else ticket.release())
                tickets.append(ticket)
                continue
            if step.action == "admit":
                ticket = await limiter.admit(who(step.key), step.cost)
            elif step.action == "slot":
                ticket = await limiter.admit_slot(who(step.key))
            else:
                ticket = tickets[step.ticket]
                await limiter.admit_tokens(ticket, step.cost)
            tickets.append(ticket)
            decision = ticket.decision
            assert decision is not None
            seen = (decision.allowed, decision.refused, decision.scope)
            assert seen == (step.allowed, step.refused, step.scope), f"step {number}: {step}"
            if step.refused and not step.allowed:
                if step.can_wait:
                    assert decision.retry_after_s is not None and 0 < decision.retry_after_s <= 86_400, step
                else:
                    assert decision.retry_after_s is None, step

    asyncio.run(run())
