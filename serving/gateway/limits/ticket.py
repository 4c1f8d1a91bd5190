"""One request's admission as the limiter keeps it (`Ticket`), the caller it was admitted for
(`Who`), the phases of an admission, and the interface both limiters implement
(`LimiterBackend`: the Redis one shared by every replica, the local one in this process).

Everything here is a value or an interface, so the two limiters and the facade that picks
between them (serving.gateway.limits.limiter) share them without importing one another.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from decimal import Decimal
from enum import Enum
from typing import ClassVar, Protocol

import anyio

from serving.gateway.config.gateway_policy import KeyLimits, TenantLimits
from serving.gateway.limits.budgets import cost_nano_usd, month_of
from serving.gateway.limits.decision import LimitDecision
from serving.gateway.metering.usage_meter import Usage
from serving.gateway.redis.client import ScriptCall

log = logging.getLogger("llmstack.gateway.limits")


class Phase(Enum):
    """Which limits one admission call checks and charges. The value is the limiter script's
    ARGV[1] (limiter_admit.lua)."""

    ALL = "all"  # every limit at once: the body is read
    SLOT = "slot"  # requests per minute and concurrency, before the body is read
    TOKENS = "tokens"  # token rate, daily and monthly budgets, for a ticket SLOT allowed

    @property
    def takes_slot(self) -> bool:
        return self is not Phase.TOKENS

    @property
    def charges_tokens(self) -> bool:
        return self is not Phase.SLOT


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


@dataclass(frozen=True)
class PhaseResult:
    """A limiter's answer to one phase: the decision, the UTC day the tokens were charged to,
    whether the key's own counters were charged (not for a shadow key over its limits), the
    tenant's limits in force, and the month's spend (Redis only: budgets live there)."""

    decision: LimitDecision
    day: int
    key_charged: bool
    tenant_limits: TenantLimits
    spend: Spend | None = None


class LimiterBackend(Protocol):
    """Where a ticket's phases are decided and its end is settled."""

    # Shared by every gateway replica (Redis), or this process's own (the local limiter).
    shared: ClassVar[bool]

    async def admit(
        self, ticket: Ticket, phase: Phase, tenant_limits: TenantLimits, *, along: ScriptCall | None = None
    ) -> PhaseResult:
        """Check and charge `phase` of `ticket`, all or nothing. `tenant_limits`: the tenant's
        limits as last known (the local limiter applies them; Redis reads the tenant's own).
        `along`: another script to send in the same Redis round trip; a limiter without Redis
        leaves it unsent."""
        ...

    async def settle(
        self, ticket: Ticket, billed: Usage, *, give_back_request: bool, along: ScriptCall | None = None
    ) -> None:
        """End `ticket`: refund what it reserved beyond `billed` and free its slot;
        `give_back_request` also returns its request to the rate limits."""
        ...

    async def aclose(self) -> None: ...


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
    backend: LimiterBackend | None = None
    settled: bool = False
    on_error: Callable[[], None] | None = None  # told when settling in Redis fails

    @property
    def allowed(self) -> bool:
        return self.decision is not None and self.decision.allowed

    @property
    def local_fallback(self) -> bool:
        """Admitted by this process's own limits because Redis failed."""
        return self.backend is not None and not self.backend.shared and self.on_error is not None

    def cost_of(self, tokens: int) -> int:
        """`tokens` at the ticket's rate, in nano-USD (0 without a rate)."""
        rate = self.usd_per_million_tokens
        return 0 if rate is None or rate <= 0 else cost_nano_usd(tokens, rate)

    def apply(self, phase: Phase, result: PhaseResult) -> None:
        """Record what `phase` decided and, when allowed, what it charged."""
        self.decision = result.decision
        self.tenant_limits = result.tenant_limits
        if not result.decision.allowed:
            return
        if phase.takes_slot:
            self.key_request_charged = result.key_charged
        if phase.charges_tokens:
            self.key_tokens_charged = result.key_charged
            self.tokens_phase_done = True
            self.day = result.day

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
                await self.backend.settle(self, billed, give_back_request=give_back_request, along=along)
            except Exception as exc:  # noqa: BLE001 - the slot then frees itself when its expiry passes
                log.warning("could not settle usage for key %s: %s", self.who.key_id, type(exc).__name__)
                if self.on_error is not None:
                    self.on_error()
