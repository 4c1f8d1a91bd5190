"""The queue stage: a slot of the model's capacity (serving.gateway.queue.fair_queue), taken by
the limiter's round trip when one was free, else waited for in the model's fair queue.

A refusal settles the limiter ticket with nothing billed and answers 429/503. A stream still
waiting after the queue's `keepalive_s` gets a `PendingSlot`: it is answered 200 at once and
kept alive while the wait goes on (serving.gateway.upstream.queued_stream). A non-streamed
request whose client leaves gives its place up.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from starlette.requests import Request

from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.limits.ticket import Ticket
from serving.gateway.metering.usage_meter import NOTHING_BILLED
from serving.gateway.protocol import errors
from serving.gateway.protocol.errors import Refusal
from serving.gateway.queue.fair_queue import FairQueue, QueueRefused, QueueTicket, QueueUnavailable, SlotTry
from serving.gateway.telemetry.metrics import GatewayMetrics

QUEUE_WAIT_HEADER = "x-queue-wait-ms"
# Queue refusals go to the access log's stream: one JSON object per line, like access lines.
events = logging.getLogger("llmstack.gateway.access")


@dataclass(frozen=True)
class ClientLeft:
    """The client disconnected while its request waited for a slot: there is nobody to answer."""


# What a wait ends with: the slot, None (go on without one: Redis failed in fail mode local), a
# refusal to answer, or the client gone.
SlotOutcome = QueueTicket | Refusal | ClientLeft | None


@dataclass
class PendingSlot:
    """A streaming request still waiting for its slot: `outcome` ends with the wait's outcome;
    `signals` gets the seconds waited every keepalive_s."""

    outcome: asyncio.Task[SlotOutcome]
    signals: asyncio.Queue[float]
    slot: QueueTicket | None = None  # once the outcome gave one


@dataclass(frozen=True)
class QueuePlace:
    """Where an admitted request stands in its model's queue: its slot (None: the model is not
    queued, or it goes on without one), or a stream's wait still going on."""

    slot: QueueTicket | None = None
    pending: PendingSlot | None = None


class _ClientGone(Exception):
    """The client disconnected while its request waited for a slot."""


def _ms(seconds: float) -> str:
    return str(round(seconds * 1000))


@dataclass
class SlotWait:
    """One request's wait for a slot of `model`. `headers` (the response's) get the time waited."""

    queue: FairQueue
    settings: GatewaySettings
    metrics: GatewayMetrics
    request: Request
    record: KeyRecord
    model: str
    tier: str
    ticket: Ticket
    headers: dict[str, str]
    stream: bool
    token: str | None  # finds the slot the limiter's try took, if its answer was lost

    def __post_init__(self) -> None:
        self.signals: asyncio.Queue[float] = asyncio.Queue()

    async def outcome(self) -> SlotOutcome:
        waiting = self.metrics.queue_waiting.labels(model=self.model, tier=self.tier)
        waiting.inc()
        started = asyncio.get_running_loop().time()
        try:
            slot = await self.queue.acquire(
                self.model,
                self.record.tenant,
                tier=self.tier,
                weight=self.record.weight or 1.0,
                deadline=started + self.settings.request_timeout_s,
                token=self.token,
                on_wait=self._keep_alive if self.stream else self._client_still_there,
            )
        except QueueRefused as refused:
            await self.ticket.settle(NOTHING_BILLED)
            return self._refused(refused, started)
        except QueueUnavailable:
            return await self._unavailable()
        except _ClientGone:
            await self.ticket.settle(NOTHING_BILLED)
            return ClientLeft()
        except BaseException:
            await self.ticket.settle(NOTHING_BILLED)
            raise
        finally:
            waiting.dec()
        self.metrics.queue_admitted.labels(model=self.model, tenant=self.record.tenant).inc()
        self.metrics.queue_wait.labels(model=self.model, tier=self.tier).observe(slot.wait_s)
        self.headers[QUEUE_WAIT_HEADER] = _ms(slot.wait_s)
        return slot

    def _refused(self, refused: QueueRefused, started: float) -> Refusal:
        refusal, record = refused.refusal, self.record
        self.metrics.queue_shed.labels(model=self.model, tenant=record.tenant, status=str(refusal.status)).inc()
        events.warning(
            json.dumps(
                {
                    "event": "queue_refused",
                    "key_id": record.key_id,
                    "tenant": record.tenant,
                    "model": self.model,
                    "tier": self.tier,
                    "status": refusal.status,
                    "code": refusal.code,
                    "reason": refusal.reason,
                }
            )
        )
        self.headers[QUEUE_WAIT_HEADER] = _ms(asyncio.get_running_loop().time() - started)
        return errors.queue_refused(
            refusal.status,
            refusal.code,
            refusal.message,
            refusal.retry_after_s,
            {QUEUE_WAIT_HEADER: self.headers[QUEUE_WAIT_HEADER]},
        )

    async def _unavailable(self) -> Refusal | None:
        self.metrics.redis_errors.labels(component="queue").inc()
        if self.settings.limiter_fail_mode == "closed":
            await self.ticket.settle(NOTHING_BILLED)
            return errors.limiter_unavailable()
        self.metrics.degraded.set(1)  # served without the model's capacity check
        return None

    async def _client_still_there(self, waited_s: float) -> None:
        if await self.request.is_disconnected():
            raise _ClientGone

    async def _keep_alive(self, waited_s: float) -> None:
        await self.signals.put(waited_s)  # the stream's writer sends a comment; it notices a client gone


def _placed(outcome: SlotOutcome) -> QueuePlace | Refusal | ClientLeft:
    return QueuePlace(slot=outcome) if outcome is None or isinstance(outcome, QueueTicket) else outcome


class QueueStage:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics, queue: FairQueue | None) -> None:
        self.settings, self.metrics, self.queue = settings, metrics, queue

    def slot_try(self, record: KeyRecord, model: str | None) -> SlotTry | None:
        """A try for a free slot of a queued model, to send in the limiter's round trip."""
        if self.queue is None or not self.queue.manages(model):
            return None
        assert model is not None
        return self.queue.try_slot(
            model, record.tenant, tier=self.settings.queue.tier(record.tier).name, weight=record.weight or 1.0
        )

    async def place(
        self,
        request: Request,
        record: KeyRecord,
        model: str | None,
        ticket: Ticket,
        headers: dict[str, str],
        *,
        stream: bool,
        attempt: SlotTry | None = None,
        slot: QueueTicket | None = None,
    ) -> QueuePlace | Refusal | ClientLeft:
        """The slot `attempt` took (`slot`), else wait for one of `model`."""
        headers[QUEUE_WAIT_HEADER] = "0"
        if self.queue is None or not self.queue.manages(model):
            return QueuePlace()
        assert model is not None
        tier = self.settings.queue.tier(record.tier).name
        if slot is not None:
            self.metrics.queue_admitted.labels(model=model, tenant=record.tenant).inc()
            self.metrics.queue_wait.labels(model=model, tier=tier).observe(0.0)
            return QueuePlace(slot=slot)
        wait = SlotWait(
            self.queue,
            self.settings,
            self.metrics,
            request,
            record,
            model,
            tier,
            ticket,
            headers,
            stream,
            attempt.token if attempt is not None else None,
        )
        if not stream:
            return _placed(await wait.outcome())
        return await _open_stream_wait(wait, headers)


async def _open_stream_wait(wait: SlotWait, headers: dict[str, str]) -> QueuePlace | Refusal | ClientLeft:
    """A stream waits until its slot comes or its first keepalive is due, whichever is first;
    past that, its response opens and the wait goes on beside it."""
    outcome = asyncio.create_task(wait.outcome())
    first_signal = asyncio.create_task(wait.signals.get())
    try:
        await asyncio.wait({outcome, first_signal}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        outcome.cancel()
        raise
    finally:
        first_signal.cancel()
    if outcome.done():
        return _placed(outcome.result())
    headers[QUEUE_WAIT_HEADER] = _ms(first_signal.result())  # so far: the stream opens now
    wait.signals.put_nowait(first_signal.result())
    return QueuePlace(pending=PendingSlot(outcome, wait.signals))
