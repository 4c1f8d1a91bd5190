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


class LocalLimiter:
    """The limiter backend of one process (serving.gateway.limits.ticket.LimiterBackend)."""

    shared: ClassVar[bool] = False

    def __init__(self, slot_ttl_s: float, concurrency_wait_s: float,
                 clock: Callable[[], float] = time.time) -> None:
        self._slot_ttl_s = slot_ttl_s  # a slot never settled (a bug, a lost task) frees itself
        self._concurrency_wait_s = concurrency_wait_s
        self._keys: dict[str, _Counters] = {}
        self._tenants: dict[str, _Counters] = {}
        self._clock = clock

    # Complex on purpose: mirrors the Lua admission phase by phase, so the two read side by side.
    async def admit(self, ticket: Ticket, phase: Phase, tenant_limits: TenantLimits, *,  # noqa: C901
                    along: ScriptCall | None = None) -> PhaseResult:
        """One phase of `ticket`, all or nothing. `along` stays unsent: there is no Redis here."""
        who, now = ticket.who, self._clock()
        day = int(now // _DAY_S)
        concurrency_wait_s = self._concurrency_wait_s
        slots_phase, tokens_phase = phase.takes_slot, phase.charges_tokens
        key = self._keys.setdefault(who.key_id, _Counters())
        tenant = self._tenants.setdefault(who.tenant, _Counters())
        key_lim = _limits(who.limits.requests_per_minute, who.limits.tokens_per_minute,
                          who.limits.daily_token_budget, who.limits.max_concurrent_requests)
        ten_lim = _limits(tenant_limits.requests_per_minute, tenant_limits.tokens_per_minute,
                          tenant_limits.daily_token_budget, tenant_limits.max_concurrent_requests)
        cost = ticket.reserved

        def check(c: _Counters, lim: dict[str, int | None]) -> _Check:
            r = _Check()
            if slots_phase:
                if lim["rpm"]:
                    r.new_req = max(c.request_tat, now) + 60 / lim["rpm"]
                    if r.new_req - 60 > now:
                        r.refuse("requests", r.new_req - 60 - now)
                c.slots = {s: exp for s, exp in c.slots.items() if exp > now}
                r.in_flight = len(c.slots)
                if lim["conc"] and r.in_flight >= lim["conc"]:
                    r.refuse("concurrency", concurrency_wait_s)
            if tokens_phase:
                if lim["tpm"]:
                    r.new_tok = max(c.token_tat, now) + cost * 60 / lim["tpm"]
                    if cost > lim["tpm"]:
                        r.refuse("tokens", math.inf)
                    elif r.new_tok - 60 > now:
                        r.refuse("tokens", r.new_tok - 60 - now)
                r.used = c.used if c.day == day else 0
                if lim["daily"]:
                    if cost > lim["daily"]:
                        r.refuse("daily_tokens", math.inf)
                    elif r.used + cost > lim["daily"]:
                        r.refuse("daily_tokens", (day + 1) * _DAY_S - now)
            return r

        def charge(c: _Counters, r: _Check, counters: bool) -> None:
            if slots_phase:
                if counters and r.new_req is not None:
                    c.request_tat = r.new_req
                c.slots[ticket.slot_id] = now + self._slot_ttl_s
            if tokens_phase and counters:
                if r.new_tok is not None:
                    c.token_tat = r.new_tok
                c.day, c.used = day, r.used + cost

        k, t = check(key, key_lim), check(tenant, ten_lim)
        allowed, refused, scope, wait, key_charged = True, None, None, 0.0, True
        if t.refused:
            allowed, refused, scope, wait = False, t.refused, "tenant", t.wait
        elif k.refused and not who.shadow:
            allowed, refused, scope, wait = False, k.refused, "key", k.wait
        elif k.refused:
            refused, scope, wait, key_charged = k.refused, "shadow", k.wait, False
            if slots_phase and k.in_flight >= who.shadow_max_concurrent:
                allowed, refused, wait = False, "concurrency", concurrency_wait_s
        if allowed:
            charge(key, k, key_charged)
            charge(tenant, t, True)
        elif phase is Phase.TOKENS:
            self._give_back(ticket, key, tenant, now, tenant_limits)
        req_iv, tok_iv = 60 / who.limits.requests_per_minute, 60 / who.limits.tokens_per_minute
        req_tat, tok_tat = max(key.request_tat, now), max(key.token_tat, now)
        decision = LimitDecision(
            allowed=allowed, refused=refused, scope=scope, limit_requests=who.limits.requests_per_minute,
            remaining_requests=math.floor((now + 60 - req_tat) / req_iv), reset_requests_s=req_tat - now,
            limit_tokens=who.limits.tokens_per_minute, remaining_tokens=math.floor((now + 60 - tok_tat) / tok_iv),
            reset_tokens_s=tok_tat - now, retry_after_s=None if wait == math.inf else wait)
        return PhaseResult(decision, day, key_charged, tenant_limits)

    def _give_back(self, ticket: Ticket, key: _Counters, tenant: _Counters, now: float,
                   tenant_limits: TenantLimits) -> None:
        key.slots.pop(ticket.slot_id, None)
        tenant.slots.pop(ticket.slot_id, None)
        if ticket.key_request_charged:
            key.request_tat = max(key.request_tat - 60 / ticket.who.limits.requests_per_minute, now)
        if tenant_limits.requests_per_minute:
            tenant.request_tat = max(tenant.request_tat - 60 / tenant_limits.requests_per_minute, now)

    async def settle(self, ticket: Ticket, billed: Usage, *, give_back_request: bool,
                     along: ScriptCall | None = None) -> None:
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
