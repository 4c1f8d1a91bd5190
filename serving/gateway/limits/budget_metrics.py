"""The budget-used gauge of one gateway replica (metric names: serving.gateway.telemetry.metrics)."""

from __future__ import annotations

import time as clock
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from decimal import Decimal

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.gateway.limits.budgets import month_of, used_ratio


class BudgetUsage(Collector):
    """`llmstack_gateway_budget_used_ratio{tenant, key_id}`: the share of its monthly budget a
    tenant (key_id "") or key had spent at its last admission on this replica. A value is shown
    only during the month it was seen in, so a budget renewed on the 1st stops alerting without
    waiting for the key's next request."""

    NAME = "llmstack_gateway_budget_used_ratio"
    HELP = (
        'Share of the monthly budget in dollars spent, by tenant and key_id ("" for the tenant\'s own '
        "budget), as of the last admission this replica saw this month."
    )

    def __init__(self, now: Callable[[], float] = clock.time) -> None:
        self._now = now
        self._seen: dict[tuple[str, str], tuple[str, float]] = {}

    def observe(self, tenant: str, key_id: str, spent_nano_usd: int, budget_usd: Decimal, moment: datetime) -> None:
        self._seen[(tenant, key_id)] = (month_of(moment), used_ratio(spent_nano_usd, budget_usd))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.HELP, labels=["tenant", "key_id"])
        current = month_of(datetime.fromtimestamp(self._now(), UTC))
        for (tenant, key_id), (month, ratio) in sorted(self._seen.items()):
            if month == current:
                family.add_metric([tenant, key_id], ratio)
        yield family

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=["tenant", "key_id"])
