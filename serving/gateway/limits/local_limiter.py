"""The limiter's rules in this process's memory: the fallback while Redis is down (fail mode
`local`), and the limiter of a gateway without Redis. The same phases, limits, shadow rules
and all-or-nothing charging as the Redis scripts (serving.gateway.limits.redis_limiter), per replica,
except monthly budgets in dollars and the usage ledger: those live in Redis only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from serving.gateway.config.gateway_policy import TenantLimits
from serving.gateway.limits.decision import LimitDecision
from serving.gateway.limits.ticket import Phase, PhaseResult, Ticket
from serving.gateway.metering.usage_meter import Usage
from serving.gateway.redis.client import ScriptCall

_DAY_S = 86_400


@dataclass
class _Counters:
    request_tat: float = 0.0
    token_tat: float = 0.0
    slots: dict[str, float] = field(default_factory=dict)  # slot id -> expiry (time.time())
    day: int = -1
    used: int = 0


@dataclass
class _Check:
    refused: str | None = None
    wait: float = 0.0  # seconds; math.inf: waiting cannot help
    new_req: float | None = None
    new_tok: float | None = None
    in_flight: int = 0
    used: int = 0

    def refuse(self, name: str, wait: float) -> None:
        if self.refused is None or wait > self.wait:
            self.refused, self.wait = name, wait


def _limits(rpm: int | None, tpm: int | None, daily: int | None, conc: int | None) -> dict[str, int | None]:
    return {"rpm": rpm, "tpm": tpm, "daily": daily, "conc": conc}


@dataclass(frozen=True)
class _Admission:
    """One phase of one admission: when it happens, what it checks, what it costs."""

    now: float
    day: int
    phase: Phase
    cost: int
    concurrency_wait_s: float

    def check(self, c: _Counters, lim: dict[str, int | None]) -> _Check:
        r = _Check()
        if self.phase.takes_slot:
            self._check_slot(c, lim, r)
        if self.phase.charges_tokens:
            self._check_tokens(c, lim, r)
        return r

    def _check_slot(self, c: _Counters, lim: dict[str, int | None], r: _Check) -> None:
        now, rpm, conc = self.now, lim["rpm"], lim["conc"]
        if rpm:
            r.new_req = max(c.request_tat, now) + 60 / rpm
            if r.new_req - 60 > now:
                r.refuse("requests", r.new_req - 60 - now)
        c.slots = {s: exp for s, exp in c.slots.items() if exp > now}
        r.in_flight = len(c.slots)
        if conc and r.in_flight >= conc:
            r.refuse("concurrency", self.concurrency_wait_s)

    def _check_tokens(self, c: _Counters, lim: dict[str, int | None], r: _Check) -> None:
        now, cost, tpm, daily = self.now, self.cost, lim["tpm"], lim["daily"]
        if tpm:
            r.new_tok = max(c.token_tat, now) + cost * 60 / tpm
            if cost > tpm:
                r.refuse("tokens", math.inf)
            elif r.new_tok - 60 > now:
                r.refuse("tokens", r.new_tok - 60 - now)
        r.used = c.used if c.day == self.day else 0
        if daily:
            if cost > daily:
                r.refuse("daily_tokens", math.inf)
            elif r.used + cost > daily:
                r.refuse("daily_tokens", (self.day + 1) * _DAY_S - now)

    def charge(self, c: _Counters, r: _Check, slot_id: str, slot_expiry: float, *, counters: bool) -> None:
        if self.phase.takes_slot:
            if counters and r.new_req is not None:
                c.request_tat = r.new_req
            c.slots[slot_id] = slot_expiry
        if self.phase.charges_tokens and counters:
            if r.new_tok is not None:
                c.token_tat = r.new_tok
            c.day, c.used = self.day, r.used + self.cost


@dataclass(frozen=True)
class _Verdict:
    allowed: bool = True
    refused: str | None = None
    scope: str | None = None
    wait: float = 0.0
    key_charged: bool = True  # a shadow key over its own limits is served without charging them


def _verdict(k: _Check, t: _Check, ticket: Ticket, at: _Admission) -> _Verdict:
    """The tenant's limits always hold; a key's own hold unless it is in shadow mode, where only
    its shadow ceiling on concurrency does."""
    who = ticket.who
    if t.refused:
        return _Verdict(False, t.refused, "tenant", t.wait)
    if k.refused and not who.shadow:
        return _Verdict(False, k.refused, "key", k.wait)
    if k.refused:
        if at.phase.takes_slot and k.in_flight >= who.shadow_max_concurrent:
            return _Verdict(False, "concurrency", "shadow", at.concurrency_wait_s, key_charged=False)
        return _Verdict(True, k.refused, "shadow", k.wait, key_charged=False)
    return _Verdict()


class LocalLimiter:
    """The limiter backend of one process (serving.gateway.limits.ticket.LimiterBackend)."""

    shared: ClassVar[bool] = False

    def __init__(self, slot_ttl_s: float, concurrency_wait_s: float, clock: Callable[[], float] = time.time) -> None:
        self._slot_ttl_s = slot_ttl_s  # a slot never settled (a bug, a lost task) frees itself
        self._concurrency_wait_s = concurrency_wait_s
        self._keys: dict[str, _Counters] = {}
        self._tenants: dict[str, _Counters] = {}
        self._clock = clock

    async def admit(
        self, ticket: Ticket, phase: Phase, tenant_limits: TenantLimits, *, along: ScriptCall | None = None
    ) -> PhaseResult:
        """One phase of `ticket`, all or nothing, in the order limiter_admit.lua takes it (so the
        two read side by side). `along` stays unsent: there is no Redis here."""
        who, now = ticket.who, self._clock()
        at = _Admission(now, int(now // _DAY_S), phase, ticket.reserved, self._concurrency_wait_s)
        key = self._keys.setdefault(who.key_id, _Counters())
        tenant = self._tenants.setdefault(who.tenant, _Counters())
        k = at.check(
            key,
            _limits(
                who.limits.requests_per_minute,
                who.limits.tokens_per_minute,
                who.limits.daily_token_budget,
                who.limits.max_concurrent_requests,
            ),
        )
        t = at.check(
            tenant,
            _limits(
                tenant_limits.requests_per_minute,
                tenant_limits.tokens_per_minute,
                tenant_limits.daily_token_budget,
                tenant_limits.max_concurrent_requests,
            ),
        )
        verdict = _verdict(k, t, ticket, at)
        if verdict.allowed:
            slot_expiry = now + self._slot_ttl_s
            at.charge(key, k, ticket.slot_id, slot_expiry, counters=verdict.key_charged)
            at.charge(tenant, t, ticket.slot_id, slot_expiry, counters=True)
        elif phase is Phase.TOKENS:
            self._give_back(ticket, key, tenant, now, tenant_limits)
        req_iv, tok_iv = 60 / who.limits.requests_per_minute, 60 / who.limits.tokens_per_minute
        req_tat, tok_tat = max(key.request_tat, now), max(key.token_tat, now)
        decision = LimitDecision(
            allowed=verdict.allowed,
            refused=verdict.refused,
            scope=verdict.scope,
            limit_requests=who.limits.requests_per_minute,
            remaining_requests=math.floor((now + 60 - req_tat) / req_iv),
            reset_requests_s=req_tat - now,
            limit_tokens=who.limits.tokens_per_minute,
            remaining_tokens=math.floor((now + 60 - tok_tat) / tok_iv),
            reset_tokens_s=tok_tat - now,
            retry_after_s=None if verdict.wait == math.inf else verdict.wait,
        )
        return PhaseResult(decision, at.day, verdict.key_charged, tenant_limits)

    def _give_back(
        self, ticket: Ticket, key: _Counters, tenant: _Counters, now: float, tenant_limits: TenantLimits
    ) -> None:
        key.slots.pop(ticket.slot_id, None)
        tenant.slots.pop(ticket.slot_id, None)
        if ticket.key_request_charged:
            key.request_tat = max(key.request_tat - 60 / ticket.who.limits.requests_per_minute, now)
        if tenant_limits.requests_per_minute:
            tenant.request_tat = max(tenant.request_tat - 60 / tenant_limits.requests_per_minute, now)

    async def settle(
        self, ticket: Ticket, billed: Usage, *, give_back_request: bool, along: ScriptCall | None = None
    ) -> None:
        """No spend and no ledger here: they live in Redis. `along` stays unsent."""
        now = self._clock()
        key = self._keys.setdefault(ticket.who.key_id, _Counters())
        tenant = self._tenants.setdefault(ticket.who.tenant, _Counters())
        refund = ticket.reserved - billed.total
        if ticket.tokens_phase_done:
            scopes = [(tenant, ticket.tenant_limits.tokens_per_minute)]
            if ticket.key_tokens_charged:
                scopes.append((key, ticket.who.limits.tokens_per_minute))
            for counters, tpm in scopes:
                if tpm:
                    counters.token_tat = max(counters.token_tat - refund * 60 / tpm, now)
                if counters.day == ticket.day:  # the refund belongs to the day that was charged
                    counters.used = max(0, counters.used - refund)
        if give_back_request:
            self._give_back(ticket, key, tenant, now, ticket.tenant_limits)
        key.slots.pop(ticket.slot_id, None)
        tenant.slots.pop(ticket.slot_id, None)

    async def aclose(self) -> None:
        return None
