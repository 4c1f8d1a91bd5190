"""Per-model capacity and a fair, prioritized wait for it, shared by every gateway replica in Redis.

    queue = FairQueue(redis_url, policy, {"llama": ModelQueue(max_ongoing_requests=48, max_replicas=2)})
    await queue.start()
    async with queue.slot("llama", tenant="acme", tier="interactive", weight=2, deadline=...) as ticket:
        ...  # forward the request; ticket.wait_s is how long it queued

A model may have `capacity` requests in flight across all gateway replicas: live replicas x
max_ongoing_requests (fair_share.capacity), or x the adapted capacity per replica when the
model is `adaptive` (serving.gateway.capacity: lower while the engine misses its latency
target). Below it, `acquire` admits in one Redis round trip (one EVALSHA, which also finds
the queue empty) and `release` frees the slot with one more.
The gateway sends neither alone (serving.gateway.admission.admitter): `try_slot` builds a script call
that takes a free slot by the same rule or answers busy, queueing nothing and pushing nobody
out, and it rides in the round trip of the limiter's admit; the release rides in the one that
settles the limiter's ticket (`QueueTicket.release_call`). So an unsaturated request pays no
round trip of its own for the queue. The try goes out before the limiter's verdict: a refused
request gives its slot straight back (`QueueTicket.discard`), and a busy try is followed by
`acquire` with the try's token, which queues.
At capacity the request waits in the model's queue, ordered by tier and, within a tier, by
start-time fair queuing across tenants (fair_share). Each release admits the next waiter inside
the same script, and no interleaving of gateway replicas admits more than capacity. The last
`reserve_share` of the capacity goes only to tenants holding less than their share of it (by
their weights, as the order): those slots may sit idle while only heavier tenants wait, so that
a light tenant's request finds one free rather than waiting for a running request to end
(nothing preempts one). On a saturated model every slot that frees is one of those, so the
weighted share is what keeps the weights there. All of it is fair_queue.lua.

Waking: the script that admits a waiter PUBLISHes to the channel of the gateway process that
owns it (one subscription per process, so no process sees other processes' wake-ups). Polling
per waiter would cost Redis a command per waiter per interval and add up to an interval of
idle capacity at every hand-over; pub/sub costs one message per admission and hands a slot over
in about one network hop. Pub/sub is fire-and-forget, so it is not the only way to learn:

Leases: every waiter and every in-flight slot has a lease in Redis that its process renews
with one script call per model per `heartbeat_s` (whatever the number of its requests). The
same call answers what became of each of them, so a lost wake-up costs at most one heartbeat.
A gateway replica that dies stops renewing: within `lease_s` its waiters leave the queue and
its slots return to the model (fair_queue.lua's `reclaim`, run by every call).

Failures: Redis errors surface as `QueueUnavailable`; the caller decides (fail open: forward
without the queue, or closed: 503), as the limiter does with `limiter_fail_mode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from serving.gateway.capacity.store import capacity_key
from serving.gateway.config.queue_policy import ModelQueue, QueuePolicy
from serving.gateway.queue.fair_share import Reason, Refusal, may_be_cold, refusal, tag_increment, wait_budget_s
from serving.gateway.redis.client import ScriptCall, raise_if_cancel_was_lost, stop_loops
from serving.gateway.redis.scripts import lua

log = logging.getLogger("llmstack.gateway.fair_queue")

LUA = lua("serving.gateway.queue", "fair_queue.lua")
CHANNEL_PREFIX = "llmstack:fq:wake:"
DEFAULT_LEASE_S = 15.0
DEFAULT_HEARTBEAT_S = 3.0

WaitHook = Callable[[float], Awaitable[None]]


class QueueKeys(NamedTuple):
    """One model's keys (layout in fair_queue.lua), under one hash tag: one Redis Cluster slot."""

    state: str
    inflight: str
    leases: str
    waiters: str
    tenants: str
    replicas: str
    slots: str
    holders: str
    capacity: str  # the adapted capacity per replica (serving.gateway.capacity.store), when the model has one
    weights: str  # tenant -> weight, of the tenants holding slots (the engine priority's weighted share)
    queues: tuple[str, ...]  # one per tier, highest priority first

    def script_keys(self) -> list[str]:
        """In the order the script's KEYS has them."""
        return [*self[:-1], *self.queues]


def queue_keys(model: str, tiers: int, *, adaptive: bool = False) -> QueueKeys:
    """`adaptive`: the model's capacity follows its latency target; otherwise the script reads a
    key nobody writes in its place, so a capacity left in Redis by an earlier adaptive run (kept
    a day) does not outlive turning it off."""
    tag = f"llmstack:{{fq:{model}}}"
    return QueueKeys(
        f"{tag}:state",
        f"{tag}:inflight",
        f"{tag}:leases",
        f"{tag}:waiters",
        f"{tag}:tenants",
        f"{tag}:replicas",
        f"{tag}:slots",
        f"{tag}:holders",
        capacity_key(model) if adaptive else f"{tag}:fixed",
        f"{tag}:weights",
        tuple(f"{tag}:q{rank}" for rank in range(tiers)),
    )


@dataclass(frozen=True)
class TenantShare:
    """What the model's slots looked like the moment a tenant took one (fair_queue.lua `share_of`):
    what the engine priority (serving.gateway.capacity.engine_priority) is derived from."""

    held: int  # slots the tenant holds, this one included
    holders: int  # tenants holding slots of the model
    weights: float  # the sum of those tenants' weights
    capacity: int  # the model's capacity across its replicas


def _share(held: Any, holders: Any, weights: Any, capacity_: Any) -> TenantShare:
    return TenantShare(int(held), int(holders), float(_text(weights)), int(capacity_))


class QueueRefused(Exception):
    """No slot: the queue was full, the wait timed out, or a fairer request took this one's place."""

    def __init__(self, refusal_: Refusal) -> None:
        super().__init__(refusal_.message)
        self.refusal = refusal_


class QueueUnavailable(RuntimeError):
    """Redis did not answer."""


@dataclass
class QueueTicket:
    """A slot in a model's capacity; release it exactly once when the response has ended."""

    model: str
    tenant: str
    tier: str
    slot_id: str
    wait_s: float
    cold: bool  # the model may have had no replica: the upstream's first byte may take a cold start
    _queue: FairQueue = field(repr=False)
    _admitted_at: float = field(repr=False)
    released: bool = False
    # The tenant's share when it took the slot (None: learned late, by a renew or cancel).
    share: TenantShare | None = None

    async def release(self) -> None:
        call = self.release_call()
        if call is not None:
            await self.finish_release(call)

    def release_call(self) -> ScriptCall | None:
        """The release as a script call another client may send in its own round trip (the
        limiter's settle does), or None when released already. Marks the ticket released: pass
        the call to `finish_release` afterwards, whether it was sent or not."""
        if self.released:
            return None
        self.released = True
        return self._queue._release_call(self)

    async def finish_release(self, call: ScriptCall) -> None:
        """Run the release alone if nobody sent it, or the round trip that carried it failed (a
        release is idempotent: a second one frees nothing twice)."""
        await _shielded(self._queue._finish_release(self.model, call))

    async def discard(self) -> None:
        """Give the slot back unused (the limiter refused the request it was taken for): a release
        whose hold time says nothing of how long the model takes to serve a request."""
        if not self.released:
            self.released = True
            await _shielded(self._queue._release_id(self.model, self.slot_id, None))


@dataclass(frozen=True)
class SlotTry:
    """A free slot asked for in another client's round trip (the limiter's admit sends `call`
    with its own script); `FairQueue.tried` reads the answer. `token` names the slot it may take."""

    model: str
    tenant: str
    tier: str
    token: str
    call: ScriptCall

    @property
    def busy(self) -> bool:
        """Redis answered that no slot was free: the try took nothing."""
        return self.call.sent and not isinstance(self.call.result, Exception) and _text(self.call.result[0]) == "B"


async def _shielded(coroutine: Awaitable[Any]) -> None:
    """Run `coroutine` to its end even if our task is cancelled meanwhile (a client disconnects):
    the cancellation still reaches us, the work carries on in its own task."""
    await asyncio.shield(asyncio.ensure_future(coroutine))


class _Outcome(NamedTuple):
    """How a wait was decided: the state, the live replicas then, and on admission by a wake-up the
    tenant's share."""

    state: str
    live: int | None
    share: TenantShare | None = None


@dataclass
class _Waiter:
    model: str
    future: asyncio.Future[_Outcome]
    waiter_id: str | None = None  # known once the admit script answered


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _live(value: Any) -> int | None:
    live = int(value)
    return None if live < 0 else live


def _service_s(value: Any) -> float | None:
    us = int(_text(value))
    return None if us < 0 else us / 1e6


class FairQueue:
    """One per gateway process. `models`: served model name -> its capacity settings."""

    def __init__(
        self,
        redis_url: str,
        policy: QueuePolicy,
        models: Mapping[str, ModelQueue],
        *,
        lease_s: float = DEFAULT_LEASE_S,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        adaptive: Collection[str] = (),
    ) -> None:
        if heartbeat_s * 2 >= lease_s:
            raise ValueError(
                f"heartbeat_s ({heartbeat_s}) must be well under lease_s ({lease_s}): "
                "a lease must survive a late heartbeat"
            )
        from serving.gateway.redis.client import redis_client

        self.policy, self.models = policy, dict(models)
        self.adaptive = frozenset(adaptive)  # models whose capacity per replica follows their latency target
        self.lease_s, self.heartbeat_s = lease_s, heartbeat_s
        self.owner = uuid.uuid4().hex
        self._redis = redis_client(redis_url)  # no retries: a retried admit could take two slots
        self._listener_redis = redis_client(redis_url)  # its own connection, held by the subscription
        self._script = self._redis.register_script(LUA)
        self._shares = ",".join(repr(tier.capacity_share) for tier in policy.tiers)
        self._reserve_share = repr(policy.reserve_share)
        self._waiting: dict[str, _Waiter] = {}  # token -> waiter
        self._held: dict[str, set[str]] = {}  # model -> slot ids this process holds
        self._tasks: list[asyncio.Task[None]] = []

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe and start the background tasks. A Redis that is down now does not stop the
        gateway from starting (fail mode local serves without it): the listener subscribes later."""
        from redis.exceptions import RedisError

        self._pubsub = self._listener_redis.pubsub(ignore_subscribe_messages=True)
        self._subscribed = False
        try:
            await self._subscribe()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("fair queue wake-up channel unavailable at start (%s); subscribing later", type(exc).__name__)
        self._tasks = [
            asyncio.create_task(self._listen(), name="fair-queue-listener"),
            asyncio.create_task(self._heartbeat(), name="fair-queue-heartbeat"),
        ]

    async def aclose(self) -> None:
        await stop_loops(self._tasks)
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()
        await self._listener_redis.aclose()
        await self._redis.aclose()

    async def _subscribe(self) -> None:
        await self._pubsub.subscribe(CHANNEL_PREFIX + self.owner)
        self._subscribed = True

    def manages(self, model: str | None) -> bool:
        """Only models the stack serves have a queue: a name from a request body never makes Redis keys."""
        return model in self.models

    # --- admission -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def slot(
        self,
        model: str,
        tenant: str,
        *,
        tier: str | None = None,
        weight: float = 1.0,
        cost: float = 1.0,
        deadline: float | None = None,
        on_wait: WaitHook | None = None,
    ) -> AsyncIterator[QueueTicket]:
        ticket = await self.acquire(
            model, tenant, tier=tier, weight=weight, cost=cost, deadline=deadline, on_wait=on_wait
        )
        try:
            yield ticket
        finally:
            await ticket.release()

    def try_slot(self, model: str, tenant: str, *, tier: str | None = None, weight: float = 1.0) -> SlotTry:
        """A free slot of `model` for `tenant` if one is free, taken by the same rule as `acquire`
        takes one at once, else nothing: it never queues, never pushes a waiter out. Its call is
        for another client to send in its own round trip (the limiter's admit does); then
        `tried` says whether it took the slot, and `acquire` with the same `token` waits for one
        when it did not (or when its answer was lost: the admit then finds the slot it took)."""
        rank = self.policy.rank(tier)
        token = uuid.uuid4().hex
        return SlotTry(
            model,
            tenant,
            self.policy.tiers[rank].name,
            token,
            self._script_call(model, "try", token, rank, tenant, repr(float(weight))),
        )

    def tried(self, attempt: SlotTry) -> QueueTicket | None:
        """The slot `attempt` took, or None: no slot was free, or its call was not sent or failed."""
        call = attempt.call
        if not call.sent or isinstance(call.result, Exception) or _text(call.result[0]) != "A":
            return None
        result = call.result
        cold = may_be_cold(_live(result[4]), self.models[attempt.model])
        share = _share(result[6], result[7], result[8], result[3])
        return self._ticket(
            attempt.model,
            attempt.tenant,
            attempt.tier,
            attempt.token,
            0.0,
            cold,
            asyncio.get_running_loop().time(),
            share,
        )

    async def forget_try(self, attempt: SlotTry) -> None:
        """Give back whatever `attempt` may have taken, when whoever sent it failed before
        reading its answer (a release frees nothing when it took nothing)."""
        if not attempt.busy:
            await _shielded(self._release_id(attempt.model, attempt.token, None))

    async def acquire(
        self,
        model: str,
        tenant: str,
        *,
        tier: str | None = None,
        weight: float = 1.0,
        cost: float = 1.0,
        deadline: float | None = None,
        on_wait: WaitHook | None = None,
        token: str | None = None,
    ) -> QueueTicket:
        """A slot of `model` for `tenant`, now or after waiting; raises `QueueRefused` or `QueueUnavailable`.

        `deadline`: the latest `loop.time()` the caller will wait until (e.g. its whole-request
        budget); the tier's queue timeout (or the model's cold-start timeout) bounds it too.
        `on_wait(seconds_waited)`: awaited every `policy.keepalive_s` while waiting, e.g. to send
        an SSE comment; an exception from it (the client is gone) gives up the place.
        `token`: a `SlotTry`'s, after it took no slot or its answer was lost."""
        config = self.models[model]
        rank = self.policy.rank(tier)
        tier_ = self.policy.tiers[rank]
        loop = asyncio.get_running_loop()
        started = loop.time()
        token = token or uuid.uuid4().hex
        waiter = _Waiter(model, loop.create_future())
        self._waiting[token] = waiter  # before the script runs: a wake-up may come before its answer
        try:
            reply = await self._call(
                model,
                "admit",
                token,
                rank,
                tenant,
                repr(tag_increment(cost, weight)),
                self.owner,
                tier_.max_queue_length,
                repr(float(weight)),
            )
        except BaseException:
            self._waiting.pop(token, None)
            raise
        state = _text(reply[0])
        capacity_, live, service = int(reply[3]), _live(reply[4]), _service_s(reply[5])
        cold = may_be_cold(live, config)
        if state == "A":
            self._waiting.pop(token, None)
            taken = _share(reply[6], reply[7], reply[8], capacity_)
            return self._ticket(model, tenant, tier_.name, token, 0.0, cold, loop.time(), taken)
        if state == "R":
            self._waiting.pop(token, None)
            raise QueueRefused(
                refusal(
                    "queue_full",
                    tenant_waiting=int(reply[2]),
                    ahead=int(reply[6]),
                    capacity_=capacity_,
                    mean_service_s=service,
                    model=model,
                    tier=tier_.name,
                )
            )
        waiter.waiter_id = _text(reply[1])
        budget = wait_budget_s(tier_.queue_timeout_s, cold, config.cold_start_timeout_s)
        until = started + budget if deadline is None else min(deadline, started + budget)
        try:
            outcome, live, share = await self._wait(waiter, until, started, on_wait)
            details = None
            if outcome == "T":
                outcome, details = await self._give_up(waiter)
        except BaseException:
            await _shielded(self._abandon(waiter))
            raise
        finally:
            self._waiting.pop(token, None)
        now = loop.time()
        if outcome == "A":
            return self._ticket(
                model, tenant, tier_.name, waiter.waiter_id, now - started, may_be_cold(live, config), now, share
            )
        if outcome == "C" and details is not None:
            remaining, capacity_, service, ahead = details
            raise QueueRefused(
                refusal(
                    "timeout",
                    tenant_waiting=remaining,
                    ahead=ahead,
                    capacity_=capacity_,
                    mean_service_s=service,
                    model=model,
                    tier=tier_.name,
                )
            )
        reason: Reason = "pushed_out" if outcome == "S" else "lost"
        raise QueueRefused(
            refusal(
                reason,
                tenant_waiting=0,
                ahead=0,
                capacity_=capacity_,
                mean_service_s=service,
                model=model,
                tier=tier_.name,
            )
        )

    async def _wait(self, waiter: _Waiter, until: float, started: float, on_wait: WaitHook | None) -> _Outcome:
        """'A' admitted, 'S' pushed out, 'G' lost, or 'T' when `until` passed first; with the live
        replica count when it was decided, and the tenant's share when a wake-up said it."""
        loop = asyncio.get_running_loop()
        keepalive = self.policy.keepalive_s
        while True:
            remaining = until - loop.time()
            if remaining <= 0:
                return _Outcome("T", None)
            step = min(remaining, keepalive) if on_wait is not None else remaining
            try:
                return await asyncio.wait_for(asyncio.shield(waiter.future), step)
            except TimeoutError:
                if on_wait is not None and loop.time() < until:
                    await on_wait(loop.time() - started)

    async def _give_up(self, waiter: _Waiter) -> tuple[str, tuple[int, int, float | None, int] | None]:
        """Leave the queue. The answer may still be 'A' (admitted meanwhile) or 'S'/'G'."""
        reply = await self._call(waiter.model, "cancel", waiter.waiter_id)
        state = _text(reply[0])
        if state != "C":
            return state, None  # 'A' this late: treated as cold, the safe side
        return state, (int(reply[1]), int(reply[2]), _service_s(reply[4]), int(reply[5]))

    async def _abandon(self, waiter: _Waiter) -> None:
        """Leave the queue for good (the client is gone or Redis failed); a slot granted meanwhile goes back."""
        try:
            state, _ = await self._give_up(waiter)
        except QueueUnavailable:
            return  # the place's lease frees it
        if state == "A":
            await self._release_id(waiter.model, waiter.waiter_id, None)

    def _ticket(
        self,
        model: str,
        tenant: str,
        tier: str,
        slot_id: str,
        wait_s: float,
        cold: bool,
        admitted_at: float,
        share: TenantShare | None = None,
    ) -> QueueTicket:
        self._held.setdefault(model, set()).add(slot_id)
        return QueueTicket(
            model=model,
            tenant=tenant,
            tier=tier,
            slot_id=slot_id,
            wait_s=wait_s,
            cold=cold,
            share=share,
            _queue=self,
            _admitted_at=admitted_at,
        )

    def _release_call(self, ticket: QueueTicket) -> ScriptCall:
        held_s = asyncio.get_running_loop().time() - ticket._admitted_at
        self._held.get(ticket.model, set()).discard(ticket.slot_id)
        return self._script_call(ticket.model, "release", ticket.slot_id, int(held_s * 1e6))

    async def _finish_release(self, model: str, call: ScriptCall) -> None:
        if call.sent and not isinstance(call.result, Exception):
            return
        try:
            if call.sent:
                raise QueueUnavailable(f"fair queue Redis call release failed: {type(call.result).__name__}")
            await self._run(call)
        except QueueUnavailable:
            log.warning("could not release a slot of model %s; its lease frees it", model)

    async def _release_id(self, model: str, slot_id: str | None, held_s: float | None) -> None:
        if slot_id is None:
            return
        self._held.get(model, set()).discard(slot_id)
        call = self._script_call(model, "release", slot_id, -1 if held_s is None else int(held_s * 1e6))
        await self._finish_release(model, call)

    # --- capacity and status ---------------------------------------------------------------

    async def set_replicas(self, model: str, replicas: int, valid_s: float) -> None:
        """Publish the model's live replica count (from whatever watches Ray Serve), valid for
        `valid_s`; afterwards the stack's max_replicas holds again. Admits waiters if it grew."""
        await self._call(model, "replicas", int(replicas), max(1, int(valid_s)))

    async def status(self, model: str) -> dict[str, Any]:
        """In flight, capacity, live replicas (None: not published), mean slot time and queue depth per tier."""
        reply = await self._call(model, "status")
        return {
            "in_flight": int(reply[0]),
            "capacity": int(reply[1]),
            "live_replicas": _live(reply[2]),
            "mean_service_s": _service_s(reply[3]),
            "queued": {tier.name: int(n) for tier, n in zip(self.policy.tiers, reply[4:])},
        }

    def _script_call(self, model: str, op: str, *args: Any) -> ScriptCall:
        config = self.models[model]
        keys = queue_keys(model, len(self.policy.tiers), adaptive=model in self.adaptive)
        return ScriptCall(
            self._script,
            keys.script_keys(),
            [
                op,
                config.max_replicas,
                config.max_ongoing_requests,
                int(self.lease_s * 1e6),
                CHANNEL_PREFIX,
                self._shares,
                self._reserve_share,
                *args,
            ],
        )

    async def _call(self, model: str, op: str, *args: Any) -> Any:
        return await self._run(self._script_call(model, op, *args))

    @staticmethod
    async def _run(call: ScriptCall) -> Any:
        from redis.exceptions import RedisError

        try:
            return await call.run()
        except (RedisError, OSError, TimeoutError) as exc:
            raise QueueUnavailable(f"fair queue Redis call {call.args[0]} failed: {type(exc).__name__}") from exc

    # --- background: wake-ups and leases -----------------------------------------------------

    def _resolve(self, token: str, state: str, live: int | None, share: TenantShare | None = None) -> None:
        waiter = self._waiting.get(token)
        if waiter is not None and not waiter.future.done():
            waiter.future.set_result(_Outcome(state, live, share))

    async def _listen(self) -> None:
        from redis.exceptions import RedisError

        while True:
            # A Redis call of the last round (a subscribe, a close) can return with aclose()'s
            # cancel eaten (Python 3.11): the listener would run on and aclose() wait for it.
            raise_if_cancel_was_lost()
            try:
                if not self._subscribed:
                    await self._subscribe()
                message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
            except (RedisError, OSError, TimeoutError) as exc:  # the heartbeat still learns every outcome
                raise_if_cancel_was_lost()  # the cancel may come back as the library's own error
                log.warning("fair queue wake-up channel failed (%s); resubscribing", type(exc).__name__)
                self._subscribed = False
                await asyncio.sleep(min(1.0, self.heartbeat_s))
                with contextlib.suppress(RedisError, OSError, TimeoutError):
                    await self._pubsub.aclose()
                self._pubsub = self._listener_redis.pubsub(ignore_subscribe_messages=True)
                continue
            if message and message.get("type") == "message":
                token, state, live, *share = _text(message["data"]).split("|")
                self._resolve(token, state, _live(live), _share(*share) if len(share) == 4 else None)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            await self.renew_once()
            raise_if_cancel_was_lost()  # as in _listen: a renewal may have eaten aclose()'s cancel

    async def renew_once(self) -> None:
        """Renew every lease this process holds and learn what became of its waiters (one call per model)."""
        for model in self.models:
            waiting = {
                w.waiter_id: token
                for token, w in list(self._waiting.items())
                if w.model == model and w.waiter_id is not None
            }
            ids = [*waiting, *self._held.get(model, ())]
            if not ids:
                continue
            try:
                states = await self._call(model, "renew", *ids)
            except QueueUnavailable as exc:
                raise_if_cancel_was_lost()  # the cancel may come back as the library's own error
                log.warning("%s; leases of model %s not renewed", exc, model)
                continue
            live = _live(states[-1])
            for slot_id, state in zip(ids, map(_text, states[:-1])):
                token = waiting.get(slot_id)
                if token is not None and state != "Q":
                    self._resolve(token, state, live)
                elif token is None and state == "G":
                    log.warning(
                        "slot %s of model %s outlived its lease (gateway stalled or Redis lost it)", slot_id, model
                    )
                    self._held.get(model, set()).discard(slot_id)
