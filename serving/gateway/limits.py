"""Per-key limits, enforced in Redis with one round trip per admission and one per settlement.

Four limits per API key, checked together and charged together (all or nothing):

- requests per minute: GCRA, weight 1, burst = one minute of capacity (a fresh key may send
  `requests_per_minute` requests at once, then one every 60/rpm seconds);
- tokens per minute: GCRA, weight = the tokens reserved at admission (see `metering`);
- max concurrent requests: a sorted set of in-flight slots, each with an expiry (the request's
  total timeout plus `SLOT_TTL_MARGIN_S`) so a gateway that crashes mid-request cannot leak a slot;
- daily token budget: a counter for the current UTC day (expires after two days).

Redis commands per admitted request: exactly 2 besides the key lookup - `EVALSHA admit` at
admission and `EVALSHA settle` when the response ends (which refunds unused reserved tokens,
corrects the daily counter and frees the slot). A refused request costs 1. redis-py's `Script`
sends EVALSHA and falls back to EVAL once on NOSCRIPT (e.g. after a Redis restart).

Time comes from Redis `TIME`, so every gateway replica shares one clock. All Redis keys of one
API key carry the hash tag `{key:<key_id>}`, so both scripts touch a single Redis Cluster slot.

When Redis fails during admission, `settings.limiter_fail_mode` decides: `closed` refuses
(503 + Retry-After); `local` admits under `LocalLimiter`, the same four limits kept in this
process's memory. Those are per replica: while Redis is down the cluster-wide allowance
becomes (number of gateway replicas) x (limit).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio

from serving.gateway.key_format import KeyRecord
from serving.gateway.metering import LimitDecision
from serving.gateway.settings import KeyLimits

log = logging.getLogger("llmstack.gateway.limits")

# A request's slot expires this long after its total timeout (settings.request_timeout_s),
# so a gateway that dies mid-request cannot hold a slot for longer than that.
SLOT_TTL_MARGIN_S = 30
# Concurrency has no exact wait: a slot frees when some in-flight response ends, which nobody
# can predict. One second is a short, honest "try again soon".
CONCURRENCY_RETRY_S = 1.0
_MINUTE_US = 60_000_000
_DAY_S = 86_400

# Shared by both scripts. Times are integer microseconds (exact in a Lua double up to 2^53);
# numbers are written with %.0f because Lua's tostring would use exponent notation.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local day = math.floor(tonumber(t[1]) / 86400)
local MINUTE = 60000000
local function num(x) return string.format('%.0f', x) end
local function tat_of(key)
  local tat = tonumber(redis.call('GET', key) or now)
  if tat < now then tat = now end
  return tat
end
local function save_tat(key, tat)
  if tat > now then redis.call('SET', key, num(tat), 'PX', num(math.ceil((tat - now) / 1000) + 1000))
  else redis.call('DEL', key) end
end
"""

# KEYS: request TAT, token TAT, in-flight slots (zset), daily usage (hash: day, used)
# ARGV: rpm, tpm, daily budget, max concurrent, reserved tokens, slot id, slot ttl (s), concurrency wait (us)
ADMIT_LUA = _PRELUDE + """
local rpm, tpm, budget = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local max_slots, cost, ttl = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[7])
local req_interval, tok_interval = MINUTE / rpm, MINUTE / tpm
local req_tat, tok_tat = tat_of(KEYS[1]), tat_of(KEYS[2])
local new_req, new_tok = req_tat + req_interval, tok_tat + cost * tok_interval
local refused, wait = false, -1
local function refuse(name, w)
  if not refused or w < 0 or (wait >= 0 and w > wait) then refused, wait = name, w end
end
-- GCRA: admit when the new theoretical arrival time is within one minute (the burst) of now.
if new_req - MINUTE > now then refuse('requests', new_req - MINUTE - now) end
if cost > tpm then refuse('tokens', -1)
elseif new_tok - MINUTE > now then refuse('tokens', new_tok - MINUTE - now) end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if redis.call('ZCARD', KEYS[3]) >= max_slots then refuse('concurrency', tonumber(ARGV[8])) end
local daily = redis.call('HMGET', KEYS[4], 'day', 'used')
local used = 0
if tonumber(daily[1]) == day then used = tonumber(daily[2]) or 0 end
if cost > budget then refuse('daily_tokens', -1)
elseif used + cost > budget then refuse('daily_tokens', (day + 1) * 86400 * 1000000 - now) end
local rem_req, rem_tok
if refused then
  rem_req = math.floor((now + MINUTE - req_tat) / req_interval)
  rem_tok = math.floor((now + MINUTE - tok_tat) / tok_interval)
  return {0, refused, rem_req, num(req_tat - now), rem_tok, num(tok_tat - now), num(wait)}
end
save_tat(KEYS[1], new_req)
save_tat(KEYS[2], new_tok)
redis.call('ZADD', KEYS[3], num(now + ttl * 1000000), ARGV[6])
redis.call('EXPIRE', KEYS[3], ttl)
redis.call('HSET', KEYS[4], 'day', day, 'used', num(used + cost))
redis.call('EXPIRE', KEYS[4], 2 * 86400)
rem_req = math.floor((now + MINUTE - new_req) / req_interval)
rem_tok = math.floor((now + MINUTE - new_tok) / tok_interval)
return {1, '', rem_req, num(new_req - now), rem_tok, num(new_tok - now), '0'}
"""

# KEYS: as for admit. ARGV: tpm, refund (reserved - billed; negative charges extra), slot id
SETTLE_LUA = _PRELUDE + """
local refund = tonumber(ARGV[2])
-- Move the token TAT back by the unused tokens, never below now: a refund cannot bank capacity.
save_tat(KEYS[2], tat_of(KEYS[2]) - refund * (MINUTE / tonumber(ARGV[1])))
local daily = redis.call('HMGET', KEYS[4], 'day', 'used')
if tonumber(daily[1]) == day then  -- a reservation made yesterday stays on yesterday's bill
  redis.call('HSET', KEYS[4], 'used', num(math.max(0, (tonumber(daily[2]) or 0) - refund)))
end
redis.call('ZREM', KEYS[3], ARGV[3])
return 1
"""


def redis_keys(key_id: str) -> list[str]:
    tag = f"llmstack:{{key:{key_id}}}"
    return [f"{tag}:rpm", f"{tag}:tpm", f"{tag}:slots", f"{tag}:daily"]


def effective_limits(record: KeyRecord, defaults: KeyLimits) -> KeyLimits:
    """The key's own limits where it has them, the gateway's defaults elsewhere."""
    overrides = {name: getattr(record, name) for name in KeyLimits.model_fields if getattr(record, name) is not None}
    return defaults.model_copy(update=overrides)


class LimiterUnavailable(RuntimeError):
    """Redis failed and the fail mode is `closed`."""


@dataclass
class Ticket:
    """An admission decision; when allowed, settle it exactly once when the response ends."""

    decision: LimitDecision
    key_id: str
    limits: KeyLimits
    reserved: int
    slot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    backend: RedisLimiter | LocalLimiter | None = None
    settled: bool = False
    on_error: Callable[[], None] | None = None  # told when settling in Redis fails

    @property
    def local_fallback(self) -> bool:
        """Admitted by this process's own limits because Redis failed."""
        return isinstance(self.backend, LocalLimiter) and self.on_error is not None

    async def settle(self, billed: int) -> None:
        if self.settled or not self.decision.allowed or self.backend is None:
            return
        self.settled = True
        with anyio.CancelScope(shield=True):  # runs on disconnect too, when our task is being cancelled
            try:
                await self.backend.settle(self, billed)
            except Exception as exc:  # the slot then frees itself when its expiry passes
                log.warning("could not settle usage for key %s: %s", self.key_id, type(exc).__name__)
                if self.on_error is not None:
                    self.on_error()


def _decision(limits: KeyLimits, reply: list) -> LimitDecision:
    allowed, refused, rem_req, reset_req, rem_tok, reset_tok, wait = reply
    refused = refused.decode() if isinstance(refused, bytes) else refused
    wait_us = float(wait)
    return LimitDecision(
        allowed=bool(int(allowed)), refused=refused or None,
        limit_requests=limits.requests_per_minute, remaining_requests=int(rem_req),
        reset_requests_s=float(reset_req) / 1e6,
        limit_tokens=limits.tokens_per_minute, remaining_tokens=int(rem_tok), reset_tokens_s=float(reset_tok) / 1e6,
        retry_after_s=None if wait_us < 0 else wait_us / 1e6)


class RedisLimiter:
    def __init__(self, redis_url: str, slot_ttl_s: int) -> None:
        from serving.gateway.redis_client import redis_client

        self._redis = redis_client(redis_url)  # no retries: a retried EVALSHA could charge twice
        self._slot_ttl_s = slot_ttl_s
        self._admit = self._redis.register_script(ADMIT_LUA)
        self._settle = self._redis.register_script(SETTLE_LUA)

    async def admit(self, ticket: Ticket) -> LimitDecision:
        limits = ticket.limits
        reply = await self._admit(keys=redis_keys(ticket.key_id), args=[
            limits.requests_per_minute, limits.tokens_per_minute, limits.daily_token_budget,
            limits.max_concurrent_requests, ticket.reserved, ticket.slot_id, self._slot_ttl_s,
            int(CONCURRENCY_RETRY_S * 1e6)])
        return _decision(limits, reply)

    async def settle(self, ticket: Ticket, billed: int) -> None:
        await self._settle(keys=redis_keys(ticket.key_id),
                           args=[ticket.limits.tokens_per_minute, ticket.reserved - billed, ticket.slot_id])

    async def aclose(self) -> None:
        await self._redis.aclose()


@dataclass
class _LocalState:
    request_tat: float = 0.0
    token_tat: float = 0.0
    in_flight: int = 0
    day: int = -1
    used: int = 0


class LocalLimiter:
    """The same four limits in this process's memory: the fallback while Redis is down, and the
    limiter of a gateway without Redis. Per replica (see the module docstring)."""

    def __init__(self) -> None:
        self._states: dict[str, _LocalState] = {}

    async def admit(self, ticket: Ticket) -> LimitDecision:
        limits, cost = ticket.limits, ticket.reserved
        state = self._states.setdefault(ticket.key_id, _LocalState())
        now, day = time.time(), int(time.time() // _DAY_S)
        if state.day != day:
            state.day, state.used = day, 0
        req_iv, tok_iv = 60 / limits.requests_per_minute, 60 / limits.tokens_per_minute
        req_tat, tok_tat = max(state.request_tat, now), max(state.token_tat, now)
        new_req, new_tok = req_tat + req_iv, tok_tat + cost * tok_iv
        waits = {"requests": new_req - 60 - now,
                 "tokens": math.inf if cost > limits.tokens_per_minute else new_tok - 60 - now,
                 "concurrency": CONCURRENCY_RETRY_S if state.in_flight >= limits.max_concurrent_requests else 0,
                 "daily_tokens": (math.inf if cost > limits.daily_token_budget else
                                  (day + 1) * _DAY_S - now if state.used + cost > limits.daily_token_budget else 0)}
        refused = max((name for name, w in waits.items() if w > 0), key=lambda n: waits[n], default=None)
        if refused is None:
            state.request_tat, state.token_tat, req_tat, tok_tat = new_req, new_tok, new_req, new_tok
            state.in_flight += 1
            state.used += cost
        wait = waits[refused] if refused else 0.0
        return LimitDecision(
            allowed=refused is None, refused=refused, limit_requests=limits.requests_per_minute,
            remaining_requests=math.floor((now + 60 - req_tat) / req_iv), reset_requests_s=req_tat - now,
            limit_tokens=limits.tokens_per_minute, remaining_tokens=math.floor((now + 60 - tok_tat) / tok_iv),
            reset_tokens_s=tok_tat - now, retry_after_s=None if wait == math.inf else wait)

    async def settle(self, ticket: Ticket, billed: int) -> None:
        state = self._states[ticket.key_id]
        refund = ticket.reserved - billed
        state.token_tat = max(state.token_tat - refund * 60 / ticket.limits.tokens_per_minute, time.time())
        state.used = max(0, state.used - refund)
        state.in_flight = max(0, state.in_flight - 1)

    async def aclose(self) -> None:
        return None


class Limiter:
    """Redis when configured, with the fail mode deciding what happens when it errors."""

    def __init__(self, redis_url: str | None, fail_mode: str, *, request_timeout_s: float,
                 on_redis_error: Callable[[], None]) -> None:
        slot_ttl_s = math.ceil(request_timeout_s) + SLOT_TTL_MARGIN_S
        self._redis = RedisLimiter(redis_url, slot_ttl_s) if redis_url else None
        self._local = LocalLimiter()
        self._fail_mode = fail_mode
        self._on_redis_error = on_redis_error

    async def admit(self, key_id: str, limits: KeyLimits, reserved: int) -> Ticket:
        ticket = Ticket(decision=None, key_id=key_id, limits=limits, reserved=reserved)  # type: ignore[arg-type]
        if self._redis is not None:
            from redis.exceptions import RedisError

            ticket.on_error = self._on_redis_error
            try:
                ticket.decision, ticket.backend = await self._redis.admit(ticket), self._redis
                return ticket
            except (RedisError, OSError, TimeoutError) as exc:
                self._on_redis_error()
                log.warning("limiter Redis failed (%s); fail mode %s", type(exc).__name__, self._fail_mode)
                if self._fail_mode == "closed":
                    raise LimiterUnavailable(type(exc).__name__) from exc
        ticket.decision, ticket.backend = await self._local.admit(ticket), self._local
        return ticket

    async def aclose(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
