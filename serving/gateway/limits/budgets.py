"""Monthly budgets in dollars: calendar-month windows (UTC), dollars <-> tokens at a model's
rate, the Redis counters and Lua the limiter scripts use, and the budget-used gauge.

A request is charged at its model's rate card (USD per 1M total tokens, `infra.plan.cost.rate_card`
rendered into the gateway's settings): at admission its reservation, at settlement corrected to
what it was billed, exactly like the token limits. Money in Redis is integer nano-dollars
(1e-9 USD): exact in Redis's 64-bit integers and in Lua's doubles up to $9M a month, and fine
enough that rounding each request up to a whole nano-dollar costs nobody a cent.

    llmstack:{tenant:<tenant>}:spend:<YYYY-MM>      (same hash tag as the limiter's counters)
        tenant          nano-USD charged this month to all the tenant's keys
        key:<key_id>    nano-USD charged this month to one key

The month is the gateway's UTC month at admission; the ticket keeps the key it charged, so a
request admitted on the 31st at 23:59:59 is settled against the month it was charged to.
Counters expire `SPEND_RETENTION_DAYS` after their month ends. The budget-used gauge is in
`serving.gateway.limits.budget_metrics`.
"""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, time, timedelta
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from functools import lru_cache

from serving.gateway.limits.usage_ledger import tenant_tag
from serving.gateway.protocol.errors import BUDGET_EXCEEDED
from serving.gateway.redis.scripts import lua

NANO_PER_USD = 10**9
SPEND_RETENTION_DAYS = 35
WARN_AT = 0.8  # budget used from which the alert fires (ops/monitoring/alerts.yaml)
REFUSAL_CODE = BUDGET_EXCEEDED

# Check and charge a request against the month's spend. All money arguments are integer
# nano-USD as strings; a budget of '0' means none. budget_check returns the scope that would go
# over ('key' or 'tenant', '' when it fits) and both amounts spent so far.
BUDGET_LUA = lua("serving.gateway.limits", "budget.lua")


# --- the calendar month ------------------------------------------------------------------


def month_of(moment: datetime) -> str:
    """`YYYY-MM` of the UTC month `moment` falls in."""
    utc = moment.astimezone(UTC)
    return f"{utc.year:04d}-{utc.month:02d}"  # strftime's format parsing is most of its cost


# The month helpers run on every admission and settlement, always with the same month or two:
# cached, since strptime and the date arithmetic were a measurable share of a request's CPU.
@lru_cache(maxsize=64)
def parse_month(text: str) -> date:
    """The first day of `YYYY-MM`; ValueError names the expected form."""
    try:
        first = datetime.strptime(text, "%Y-%m").date()
    except ValueError:
        raise ValueError(f"month {text!r} is not YYYY-MM, e.g. 2026-11") from None
    return first


@lru_cache(maxsize=64)
def month_window(month: str) -> tuple[datetime, datetime]:
    """[start, end) of a calendar month in UTC."""
    first = parse_month(month)
    following = date(first.year + first.month // 12, first.month % 12 + 1, 1)
    return (datetime.combine(first, time(), tzinfo=UTC), datetime.combine(following, time(), tzinfo=UTC))


def seconds_until_next_month(moment: datetime) -> float:
    """When an exhausted monthly budget renews: the Retry-After of its 429."""
    return (month_window(month_of(moment))[1] - moment).total_seconds()


def spend_key(tenant: str, month: str) -> str:
    parse_month(month)
    return f"{tenant_tag(tenant)}:spend:{month}"


@lru_cache(maxsize=64)
def month_end_s(month: str) -> int:
    """Epoch seconds when `month` ends (UTC)."""
    return int(month_window(month)[1].timestamp())


@lru_cache(maxsize=64)
def spend_expire_at(month: str) -> int:
    return int((month_window(month)[1] + timedelta(days=SPEND_RETENTION_DAYS)).timestamp())


# --- dollars and tokens ------------------------------------------------------------------


def nano_usd(usd: Decimal) -> int:
    """A budget in nano-dollars (rounded down: a budget never grows by rounding)."""
    return int((Decimal(usd) * NANO_PER_USD).to_integral_value(rounding=ROUND_FLOOR))


def cost_nano_usd(tokens: int, usd_per_million_tokens: Decimal) -> int:
    """What `tokens` cost at the rate, in nano-dollars, rounded up (a request is never free).
    One million tokens at $1 is 1e9 nano-dollars, so a token at $r/1M is r x 1000."""
    exact = Decimal(tokens) * Decimal(usd_per_million_tokens) * 1000
    return int(exact.to_integral_value(rounding=ROUND_CEILING))


def tokens_for_usd(usd: Decimal, usd_per_million_tokens: Decimal) -> int:
    """How many tokens of a model `usd` buys at its rate (whole tokens, rounded down): what a
    dollar budget means to someone who thinks in tokens."""
    rate = Decimal(usd_per_million_tokens)
    if rate <= 0:
        raise ValueError("a rate of $0 per token makes a dollar budget unlimited; give the model a rate")
    return int((Decimal(usd) * 1_000_000 / rate).to_integral_value(rounding=ROUND_FLOOR))


def used_ratio(spent_nano_usd: int, budget_usd: Decimal) -> float:
    budget = nano_usd(budget_usd)
    return math.inf if budget <= 0 else spent_nano_usd / budget
