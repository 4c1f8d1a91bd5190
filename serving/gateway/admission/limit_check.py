"""The limit stage: one limiter phase, its verdict turned into what admission does next.

Shadow-mode keys are served when over their own limits; the would-be refusal is logged and
counted. Every phase sets the `degraded` gauge from what it saw of Redis (a key from the outage
cache, or the local limiter standing in) and the budget-used gauge from the spend it saw.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable
from decimal import Decimal

from serving.gateway.admission.authenticate import Caller
from serving.gateway.limits.budgets import NANO_PER_USD
from serving.gateway.limits.decision import rate_limit_headers
from serving.gateway.limits.limiter import LimiterBusy, LimiterOutOfMemory, LimiterUnavailable
from serving.gateway.limits.ticket import Ticket
from serving.gateway.protocol import errors
from serving.gateway.protocol.errors import Refusal
from serving.gateway.telemetry.metrics import GatewayMetrics

# Shadow-mode refusals go to the access log's stream: one JSON object per line, like access lines.
events = logging.getLogger("llmstack.gateway.access")

_LIMIT_FIELD = {
    "requests": "requests_per_minute",
    "tokens": "tokens_per_minute",
    "concurrency": "max_concurrent_requests",
    "daily_tokens": "daily_token_budget",
}


class LimitCheck:
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def run(
        self, call: Awaitable[Ticket | None], caller: Caller, ticket: Ticket | None = None
    ) -> Ticket | Refusal:
        """Run one limiter phase (`call` returns the ticket, or None when it completes `ticket`):
        the ticket when the request may go on, else the refusal to answer."""
        try:
            result = await call
        except LimiterOutOfMemory:
            self.metrics.redis_out_of_memory.labels(component="limiter").inc()
            return errors.limiter_unavailable()
        except LimiterUnavailable:
            return errors.limiter_unavailable()
        except LimiterBusy:
            return errors.gateway_busy()
        ticket = result if result is not None else ticket
        assert ticket is not None and ticket.decision is not None
        self.metrics.degraded.set(1 if caller.from_cache or ticket.local_fallback else 0)
        self.metrics.observe_budgets(ticket)
        decision = ticket.decision
        if decision.refused is None:
            return ticket
        shadowed = decision.allowed
        self.metrics.rate_limited.labels(limit=decision.refused, mode="shadow" if shadowed else "enforced").inc()
        if shadowed:
            record = caller.record
            events.warning(
                json.dumps(
                    {
                        "event": "shadow_rate_limited",
                        "key_id": record.key_id,
                        "tenant": record.tenant,
                        "limit": decision.refused,
                        "reserved": ticket.reserved,
                    }
                )
            )
            return ticket
        if decision.refused == "monthly_budget":
            return errors.monthly_budget_exceeded(
                _budget_usd(ticket), decision.retry_after_s, rate_limit_headers(decision), scope=decision.scope or "key"
            )
        return errors.rate_limited(
            decision.refused,
            _limit_value(ticket),
            decision.retry_after_s,
            rate_limit_headers(decision),
            scope=decision.scope or "key",
        )


def _budget_usd(ticket: Ticket) -> Decimal:
    if ticket.decision is not None and ticket.decision.scope == "tenant" and ticket.spend is not None:
        return Decimal(ticket.spend.tenant_budget_nano_usd) / NANO_PER_USD
    return ticket.who.monthly_budget_usd or Decimal(0)


def _limit_value(ticket: Ticket) -> int:
    decision, who = ticket.decision, ticket.who
    assert decision is not None and decision.refused is not None
    field = _LIMIT_FIELD[decision.refused]
    if decision.scope == "tenant":
        return getattr(ticket.tenant_limits, field) or 0
    if decision.scope == "shadow":
        return who.shadow_max_concurrent
    limit: int = getattr(who.limits, field)
    return limit
