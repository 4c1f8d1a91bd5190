"""What a batch may take before it is created: the key's remaining budgets, and its share of Redis.

A batch's lines are admitted one by one as they run, like online requests, and a line its daily
or monthly budget refuses stops the batch (runner.QUOTA_CODES). So a batch that cannot complete
within what its key and tenant have left would only hold Redis for nothing: create refuses it.
"Cannot" is proven, not guessed: its largest line's reservation (what admission will charge it,
`lines.line_reservation`) does not fit what is left, or its lines together cannot cost less than
what is left (each bills at least one token). The sum of reservations would be no proof (they
are settled down to what each line used) and would refuse every large batch without max_tokens.
That is a bound read once, not a charge: other requests may spend the budget meanwhile.

A running batch holds Redis memory for each line: its custom_id (the output's order), a
reference into the batch's lines file in storage (the bodies are not in Redis), and the answer
of each line refused up front. `redis_footprint` bounds those bytes, and store.ADMIT_LUA caps
them, with the number of active batches, per tenant and for the whole gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from serving.gateway.auth.adapter_access import base_of
from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.batch.lines import CheckedInput
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.limits.budgets import REFUSAL_CODE, cost_nano_usd, month_of, nano_usd, spend_key
from serving.gateway.limits.limiter import effective_limits
from serving.gateway.limits.tenants import key_daily_key, tenant_daily_key, tenant_limits_key

# Redis's own bytes around each value (a list entry, a stream entry with its id and fields, a hash
# field), and the allocator's size classes on top, measured with MEMORY USAGE on Redis 7 for
# custom ids of 1 to 512 characters (tests/serving/gateway/batch/test_quota.py keeps the bound
# above what a real redis-server holds, and within 3x of it).
ID_OVERHEAD = 48
ENTRY_OVERHEAD = 64
ANSWER_ENVELOPE = 160  # an output line around its body: its id, status, request id (plus the custom_id)
ANSWER_OVERHEAD = 96
ALLOCATOR_SLACK = 1.25


def redis_footprint(checked: CheckedInput) -> int:
    """The most bytes a batch's lines hold in Redis while it runs: every custom_id in the ids
    list, a stream entry (custom_id and where its body is) per line to run, the answer of each
    line refused up front (its error line, which names the custom_id, under the custom_id).
    Answers of lines that ran come on top, each bounded by what it was billed."""
    every_id = [x.custom_id for x in checked.lines] + [x.custom_id for x in checked.rejected]
    ids = sum(len(custom_id.encode()) + ID_OVERHEAD for custom_id in every_id)
    queued = sum(len(x.custom_id.encode()) + ENTRY_OVERHEAD for x in checked.lines)
    refused = sum(
        2 * len(x.custom_id.encode()) + x.answer_bytes + ANSWER_ENVELOPE + ANSWER_OVERHEAD for x in checked.rejected
    )
    return int(ALLOCATOR_SLACK * (ids + queued + refused))


@dataclass(frozen=True)
class BudgetLeft:
    """What a key and its tenant may still spend: tokens today, nano-USD this month (None: no budget)."""

    key_tokens: int | None
    tenant_tokens: int | None
    key_nano_usd: int | None
    tenant_nano_usd: int | None


@dataclass(frozen=True)
class Need:
    """What a batch needs to complete: its largest line's reservation, and the least all its
    lines together can cost (one token each), in tokens and in nano-USD at each line's rate."""

    largest_tokens: int
    least_tokens: int
    largest_nano_usd: int
    least_nano_usd: int


@dataclass(frozen=True)
class Shortfall:
    code: str
    message: str


def batch_need(checked: CheckedInput, settings: GatewaySettings) -> Need:
    largest_tokens = least_tokens = largest_cost = least_cost = 0
    for line in checked.lines:
        largest_tokens, least_tokens = max(largest_tokens, line.reserved), least_tokens + 1
        rate = settings.model_usd_per_million_tokens.get(base_of(line.model, settings.models))  # an adapter: its base's
        if rate is not None and rate > 0:
            largest_cost = max(largest_cost, cost_nano_usd(line.reserved, rate))
            least_cost += cost_nano_usd(1, rate)
    return Need(largest_tokens, least_tokens, largest_cost, least_cost)


def shortfall(need: Need, left: BudgetLeft) -> Shortfall | None:
    """Why a batch that needs `need` cannot complete within `left`, or None when it may."""
    for whose, room in (("this API key", left.key_tokens), ("this API key's tenant", left.tenant_tokens)):
        if room is None:
            continue
        if need.largest_tokens > room:
            return Shortfall(
                "daily_token_budget_exceeded",
                f"A request of the batch reserves {need.largest_tokens} tokens, more than the "
                f"{max(0, room)} left today in the daily token budget of {whose}: it could never run. "
                "Lower its max_tokens (or prompt), or wait for tomorrow's budget (UTC).",
            )
        if need.least_tokens > room:
            return Shortfall(
                "daily_token_budget_exceeded",
                f"The batch's {need.least_tokens} requests cost at least a token each, more than the "
                f"{max(0, room)} left today in the daily token budget of {whose}. Split the batch.",
            )
    for whose, room in (("this API key", left.key_nano_usd), ("this API key's tenant", left.tenant_nano_usd)):
        if room is None:
            continue
        for needed, what in (
            (need.largest_nano_usd, "A request of the batch may cost"),
            (need.least_nano_usd, "The batch's requests together cost at least"),
        ):
            if needed > room:
                return Shortfall(
                    REFUSAL_CODE,
                    f"{what} ${Decimal(needed) / 10**9:.6f}, more than the "
                    f"${Decimal(max(0, room)) / 10**9:.6f} left this month in the monthly budget of "
                    f"{whose}. Ask your platform team for a higher budget.",
                )
    return None


async def budget_left(redis: Any, key: KeyRecord, settings: GatewaySettings, moment: Any) -> BudgetLeft:
    """The key's and its tenant's budgets left, read from the limiter's own counters (one round
    trip). `moment`: now, a UTC datetime (the month); the day is Redis's, as the limiter's."""
    tenant, month = key.tenant, month_of(moment)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.time()
        pipe.hmget(key_daily_key(tenant, key.key_id), ["day", "used"])
        pipe.hmget(tenant_daily_key(tenant), ["day", "used"])
        pipe.hmget(tenant_limits_key(tenant), ["daily_token_budget", "monthly_budget_usd"])
        pipe.hmget(spend_key(tenant, month), [f"key:{key.key_id}", "tenant"])
        (seconds, _), key_day, tenant_day, stored, spent = await pipe.execute()
    today = int(seconds) // 86_400

    def used(day_used: list[Any]) -> int:
        day, count = day_used
        return int(count) if day is not None and count is not None and int(day) == today else 0

    defaults = settings.default_tenant_limits
    key_daily = None if key.shadow else effective_limits(key, settings.default_limits).daily_token_budget
    tenant_daily = int(stored[0]) if stored[0] is not None else defaults.daily_token_budget
    key_monthly = None if key.shadow or key.monthly_budget_usd is None else nano_usd(key.monthly_budget_usd)
    tenant_usd = Decimal(stored[1]) if stored[1] is not None else defaults.monthly_budget_usd
    tenant_monthly = None if tenant_usd is None or tenant_usd <= 0 else nano_usd(tenant_usd)
    return BudgetLeft(
        key_tokens=None if key_daily is None else key_daily - used(key_day),
        tenant_tokens=None if tenant_daily is None else tenant_daily - used(tenant_day),
        key_nano_usd=None if key_monthly is None else key_monthly - int(spent[0] or 0),
        tenant_nano_usd=None if tenant_monthly is None else tenant_monthly - int(spent[1] or 0),
    )
