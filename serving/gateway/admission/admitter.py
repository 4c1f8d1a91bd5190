"""Admission: the one place that decides whether a request may reach the model servers.

Steps, cheapest first, so that what costs the gateway work is only done for requests that
may go on: authenticate the key (before any of the body is read, so unauthenticated callers
cannot make the gateway read or buffer anything); for a body that may be large (declared over
`EARLY_READ_BYTES`, or of undeclared length) take the key's and tenant's request and
concurrency allowance first (`Limiter.admit_slot`), so one key can keep at most its
concurrency limit of bodies in flight; read the body within `max_body_bytes` and parse it
once (`parse_document`); check the key's model allow-list and the request policy
(serving.gateway.admission.validation); reserve tokens (serving.gateway.metering.reservation) and charge them
(`admit_tokens`, or all limits at once with `admit` for a small body already read: one Redis
round trip, which also tries for a free slot of a queued model: serving.gateway.queue.fair_queue);
then, only when no slot was free, wait for one in the model's fair queue. A refusal after the
slot phase gives back everything the slot phase took, and a slot the try took.

The rest of the gateway sees one `Admission` (with a `Ticket` to settle when the response ends)
or one error response.

Redis outages: a key verified in the last `key_cache_ttl_s` is still accepted (keys.RecentlyVerifiedKeys)
and the limiter falls back as its fail mode says; either sets the `degraded` gauge. A busy
Redis pool is not an outage: 503 + Retry-After (serving.gateway.redis.client). Keys in shadow
mode are served when over their own limits, and the would-be refusal is logged and counted.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from serving.gateway.admission.batch_caller import BATCH_CALLER, BatchCaller
from serving.gateway.admission.body import BodyError, request_document
from serving.gateway.admission.media_urls import check_media
from serving.gateway.admission.validation import check_request
from serving.gateway.auth.key_format import KeyRecord, is_usable
from serving.gateway.auth.keys import KeyStore, KeyStoreUnavailable, RecentlyVerifiedKeys
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.limits.budgets import NANO_PER_USD
from serving.gateway.limits.decision import rate_limit_headers
from serving.gateway.limits.limiter import (
    Limiter,
    LimiterBusy,
    LimiterOutOfMemory,
    LimiterUnavailable,
    effective_limits,
)
from serving.gateway.limits.ticket import Ticket, Who
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.metering.reservation import COMPLETION_PATHS, Reservation, reserve
from serving.gateway.metering.usage_meter import (
    NOTHING_BILLED,
    Usage,
    UsageMeter,
    client_usage_wishes,
    request_usage_upstream,
    wants_stream,
)
from serving.gateway.protocol import errors
from serving.gateway.queue.fair_queue import FairQueue, QueueRefused, QueueTicket, QueueUnavailable, SlotTry
from serving.gateway.redis.client import RedisBusy
from serving.gateway.telemetry.access_log import caller_of, note_caller
from serving.gateway.telemetry.metrics import GatewayMetrics

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first"
# Shadow-mode and queue refusals go to the access log's stream: one JSON object per line, like access lines.
events = logging.getLogger("llmstack.gateway.access")
PROMPT_LOG_CHARS = 2000
# A body that declares at most this many bytes is read before the limiter is asked: reading it
# costs less than the Redis round trip a separate slot phase would add, and its memory is small.
EARLY_READ_BYTES = 65_536


@dataclass(frozen=True)
class Admission:
    """An admitted request: who sent it, its body (already read, and possibly rewritten to ask
    for stream usage), the model it names, its limiter ticket, the x-ratelimit-* headers for
    the response, and the meter that bills it."""

    key: KeyRecord
    body: bytes
    model: str | None
    ticket: Ticket
    headers: dict[str, str]
    meter: UsageMeter
    queue_ticket: QueueTicket | None = None  # the model's slot (serving.gateway.queue.fair_queue), when queued
    first_byte_timeout_s: float | None = None  # a cold model's start, instead of upstream_idle_timeout_s
    pending: PendingSlot | None = None  # a stream still waiting for its slot

    async def settle(self, billed: Usage) -> None:
        """End the request once: bill the key's usage and give the model's slot back, in one
        Redis round trip when Redis settles the ticket (the slot's release rides along)."""
        slot = self.queue_ticket if self.pending is None else self.pending.slot
        release = slot.release_call() if slot is not None else None
        try:
            await self.ticket.settle(billed, along=release)
        finally:
            if slot is not None and release is not None:
                await slot.finish_release(release)


@dataclass
class PendingSlot:
    """A streaming request still waiting for its slot: `outcome` ends with the slot (or None: go
    on without one) or the refusal to send; `signals` gets the seconds waited every keepalive_s."""

    outcome: asyncio.Task[QueueTicket | Response | None]
    signals: asyncio.Queue[float]
    slot: QueueTicket | None = None  # once the outcome gave one


def first_byte_timeout(settings: GatewaySettings, slot: QueueTicket | None) -> float | None:
    """A model that may have no replica gets its cold start as the upstream's idle timeout."""
    if slot is None or not slot.cold:
        return None
    return max(settings.upstream_idle_timeout_s, settings.model_queues[slot.model].cold_start_timeout_s)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class ClientGone(Exception):
    """The client disconnected while its request waited for a slot."""


QUEUE_WAIT_HEADER = "x-queue-wait-ms"


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer <key>`, else from `X-API-Key: <key>`."""
    authorization = headers.get("authorization", "")
    scheme, _, credential = authorization.partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    return headers.get("x-api-key", "").strip() or None


def requested_model(document: dict[str, Any] | None) -> str | None:
    """The `model` field of a request's JSON object; None when it names no model as a string."""
    model = document.get("model") if document is not None else None
    return model if isinstance(model, str) else None


def declares_small_body(headers: Mapping[str, str]) -> bool:
    declared = headers.get("content-length", "")
    return declared.isdigit() and int(declared) <= EARLY_READ_BYTES


def model_allowed(key: KeyRecord, model: str | None, *, has_body: bool) -> bool:
    """Unrestricted keys may call anything. A restricted key's bodiless requests (GET /v1/models)
    are not model-scoped, but a body must name an allowed model: a body we cannot read a model
    from might still be one the upstream reads a model from."""
    if key.allowed_models is None:
        return True
    if model is None:
        return not has_body
    return model in key.allowed_models


def reservation_for(document: dict[str, Any] | None, body_size: int, path: str,
                    settings: GatewaySettings) -> tuple[Reservation, int | None]:
    """What a request reserves at admission, and the max_tokens the gateway adds to it (None
    when the body sets its own): for online requests and batch lines alike."""
    context_length = settings.model_context_lengths.get(requested_model(document) or "")
    output = output_bound(document, path, context_length=context_length, ceiling=settings.max_tokens_ceiling)
    reservation = reserve(document, body_size, path, output=output, context_length=context_length,
                          template_tokens=settings.chat_template_tokens)
    return reservation, output.added_max_tokens


async def read_body_within(request: Request, limit: int,
                           on_chunk: Callable[[bytes, int], None] | None = None) -> bytes | None:
    """The body, or None as soon as it is known to exceed `limit` bytes. Checks the declared
    Content-Length first, then counts while reading, since chunked bodies declare nothing.
    `on_chunk(chunk, size so far)` sees each chunk before it is kept (it may raise to stop)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        if on_chunk is not None:
            on_chunk(chunk, size)
        parts.append(chunk)
    return b"".join(parts)


class Admitter:
    """Admission with what it needs: the key store (and its outage cache), the limiter, the
    settings and the metrics (each admission sets the `degraded` gauge from what it saw of Redis)."""

    def __init__(self, settings: GatewaySettings, key_store: KeyStore, limiter: Limiter,
                 metrics: GatewayMetrics, queue: FairQueue | None = None) -> None:
        self.settings, self.key_store, self.limiter, self.metrics = settings, key_store, limiter, metrics
        self.queue = queue
        self.recent_keys = RecentlyVerifiedKeys(settings.key_cache_ttl_s)

    async def _verify(self, key: str) -> tuple[KeyRecord | None, bool]:
        """(record, came from the outage cache). A busy pool raises RedisBusy: not an outage."""
        try:
            record = await self.key_store.verify(key)
        except KeyStoreUnavailable:
            self.metrics.redis_errors.labels(component="keys").inc()
            return self.recent_keys.recall(key), True
        self.recent_keys.remember(key, record)
        return record, False

    async def authenticate(self, request: Request) -> tuple[KeyRecord, bool] | Response:
        """The caller's key record and whether it came from the outage cache, or the 401/503 to answer.
        A batch line (serving.gateway.batch.runner) names its key by id in the ASGI scope instead
        of presenting it: the key is read again, so a revoked or expired key stops its batch."""
        caller = request.scope.get(BATCH_CALLER)
        try:
            if isinstance(caller, BatchCaller):
                try:
                    record = await self.key_store.get(caller.key_id)
                except KeyStoreUnavailable:
                    return errors.key_store_unavailable()
                record = caller.record(record) if record is not None and is_usable(record, _utcnow()) else None
                from_cache = False
            else:
                key = presented_key(request.headers)
                if key is None:
                    return errors.missing_api_key()
                record, from_cache = await self._verify(key)
        except RedisBusy:
            return errors.gateway_busy()
        if record is None:
            return errors.key_store_unavailable() if from_cache else errors.invalid_api_key()
        note_caller(request.scope, record)
        return record, from_cache

    async def admit(self, request: Request) -> Admission | Response:
        known = await self.authenticate(request)
        if isinstance(known, Response):
            return known
        record, from_cache = known
        who = self._who(record)
        ticket = None
        if request.method != "GET" and not declares_small_body(request.headers):
            ticket, refusal = await self._limited(self.limiter.admit_slot(who), record, from_cache)
            if refusal is not None:
                return refusal
        try:
            outcome = await self._admit_body(request, record, who, ticket, from_cache)
        except BaseException:
            if ticket is not None:
                await ticket.release()
            raise
        if isinstance(outcome, Response) and ticket is not None:
            await ticket.release()  # a no-op when the token phase refused (it gave everything back)
        return outcome

    def _who(self, record: KeyRecord) -> Who:
        settings = self.settings
        return Who(key_id=record.key_id, tenant=record.tenant, limits=effective_limits(record, settings.default_limits),
                   tenant_defaults=settings.default_tenant_limits, shadow=record.shadow,
                   shadow_max_concurrent=settings.shadow_max_concurrent_requests,
                   monthly_budget_usd=record.monthly_budget_usd)

    async def admit_call(self, record: KeyRecord, from_cache: bool) -> tuple[Ticket | None, Response | None]:
        """A call the gateway answers itself (the Batch API) counts against the key's and the
        tenant's requests per minute and concurrency like any request, so uploads and polling
        cannot flood the gateway: (the ticket to settle when the call ends, None), or the refusal."""
        ticket, refusal = await self._limited(self.limiter.admit_slot(self._who(record)), record, from_cache)
        return (None, refusal) if refusal is not None else (ticket, None)

    # Complex on purpose: the admission steps in order; the pipeline rework splits them into stages.
    async def _admit_body(self, request: Request, record: KeyRecord, who: Who, ticket: Ticket | None,  # noqa: C901
                          from_cache: bool) -> Admission | Response:
        settings, path = self.settings, request.url.path
        body = await read_body_within(request, settings.max_body_bytes)
        if body is None:
            return errors.body_too_large(settings.max_body_bytes)
        document = request_document(body, request.url.path, settings)  # the one parse, bounded
        if isinstance(document, BodyError):
            return errors.invalid_request(document.param, document.message, document.code)
        model = requested_model(document)
        caller_of(request.scope).model = model
        if not model_allowed(record, model, has_body=document is not None):
            return errors.model_not_allowed(model)
        violation = check_request(document, path, settings)  # before tokens are charged: a refusal costs none
        if violation is None and document is not None:
            violation = check_media(document, settings.media_domains(model))
        if violation is not None:
            return errors.invalid_request(violation.param, violation.message, violation.code)
        if settings.log_prompts and document is not None:
            caller_of(request.scope).prompt = prompt_text(document)

        reservation, added_max_tokens = reservation_for(document, len(body), path, settings)
        label = self.metrics.model_label(model)  # the ledger's model, bounded like the metrics'
        rate = settings.model_usd_per_million_tokens.get(label)
        # A queued model's free slot is asked for in the limiter's round trip, before its verdict:
        # a refused request gives it straight back (a round trip on refusals only). When the round
        # trip itself failed, whether the try ran is unknown: a slot it took is renewed by nobody,
        # so its lease frees it (or, in fail mode local, the acquire below finds it by its token).
        queue, attempt = self.queue, self._slot_try(record, model)
        along = attempt.call if attempt is not None else None
        try:
            if ticket is None:
                ticket, refusal = await self._limited(
                    self.limiter.admit(who, reservation.total, along=along, model=label, usd_per_million_tokens=rate),
                    record, from_cache)
            else:
                _, refusal = await self._limited(
                    self.limiter.admit_tokens(ticket, reservation.total, along=along, model=label,
                                              usd_per_million_tokens=rate), record, from_cache, ticket)
        except BaseException:
            if queue is not None and attempt is not None:
                await queue.forget_try(attempt)
            raise
        slot = queue.tried(attempt) if queue is not None and attempt is not None else None
        try:
            if refusal is not None:
                if slot is not None:
                    await slot.discard()
                return refusal
            assert ticket is not None and ticket.decision is not None
            headers = rate_limit_headers(ticket.decision)
            if ticket.decision.refused is not None:  # allowed: a shadow key's would-be refusal
                headers = {name: value for name, value in headers.items() if name != "retry-after"}

            stream = wants_stream(document, path)
            final_usage, continuous_usage = client_usage_wishes(document) if document is not None else (True, True)
            upstream_document = upstream_request(document, path, stream=stream,
                                                 added_max_tokens=added_max_tokens,
                                                 priority=self._engine_priority(record))
            queued = await self._queued(request, record, model, ticket, headers, stream=stream, attempt=attempt,
                                        slot=slot)
        except BaseException:
            if slot is not None:
                await slot.discard()
            raise
        if isinstance(queued, Response):
            return queued
        pending = queued if isinstance(queued, PendingSlot) else None
        queue_ticket = None if isinstance(queued, PendingSlot) else queued
        if upstream_document is not document:
            body = json.dumps(upstream_document).encode()
        meter = UsageMeter(stream=stream, reservation=reservation, client_final_usage=final_usage,
                           client_continuous_usage=continuous_usage)
        return Admission(key=record, body=body, model=model, ticket=ticket, headers=headers, meter=meter,
                         queue_ticket=queue_ticket, first_byte_timeout_s=first_byte_timeout(settings, queue_ticket),
                         pending=pending)

    # --- the fair queue: a slot of the model's capacity, tried with the limiter's admit ----

    def _engine_priority(self, record: KeyRecord) -> int | None:
        """vLLM's `priority` (lower runs first) from the key's tier, when the stack enables it."""
        policy = self.settings.queue
        return policy.rank(record.tier) if policy.engine_priority else None

    def _slot_try(self, record: KeyRecord, model: str | None) -> SlotTry | None:
        if self.queue is None or not self.queue.manages(model):
            return None
        assert model is not None
        return self.queue.try_slot(model, record.tenant, tier=self.settings.queue.tier(record.tier).name)

    # Complex on purpose: the queue's outcomes in order; the pipeline rework splits them into stages.
    async def _queued(self, request: Request, record: KeyRecord, model: str | None, ticket: Ticket,  # noqa: C901
                      headers: dict[str, str], *, stream: bool, attempt: SlotTry | None = None,
                      slot: QueueTicket | None = None) -> QueueTicket | None | Response | PendingSlot:
        """The slot `attempt` took (`slot`), else wait for one of `model` (None: the model is not
        queued, or Redis failed in fail mode local). A refusal settles the limiter ticket with
        nothing billed and answers 429/503. A stream still waiting after `keepalive_s` gets a
        `PendingSlot`: the caller answers 200 at once and keeps the connection alive while the
        wait goes on (serving.gateway.upstream.queued_stream)."""
        queue = self.queue
        headers[QUEUE_WAIT_HEADER] = "0"
        if queue is None or not queue.manages(model):
            return None
        assert model is not None
        tier = self.settings.queue.tier(record.tier).name
        if slot is not None:
            self.metrics.queue_admitted.labels(model=model, tenant=record.tenant).inc()
            self.metrics.queue_wait.labels(model=model, tier=tier).observe(0.0)
            return slot
        token = attempt.token if attempt is not None else None  # finds the slot the try took, if its answer was lost
        loop = asyncio.get_running_loop()
        signals: asyncio.Queue[float] = asyncio.Queue()

        async def client_still_there(waited_s: float) -> None:
            if await request.is_disconnected():
                raise ClientGone

        async def keep_alive(waited_s: float) -> None:
            await signals.put(waited_s)  # the stream's writer sends a comment; it notices a client gone

        async def wait_for_slot() -> QueueTicket | None | Response:
            waiting = self.metrics.queue_waiting.labels(model=model, tier=tier)
            waiting.inc()
            started = loop.time()
            try:
                slot = await queue.acquire(model, record.tenant, tier=tier, weight=record.weight or 1.0,
                                           deadline=started + self.settings.request_timeout_s,
                                           on_wait=keep_alive if stream else client_still_there, token=token)
            except QueueRefused as refused:
                await ticket.settle(NOTHING_BILLED)
                refusal = refused.refusal
                self.metrics.queue_shed.labels(model=model, tenant=record.tenant, status=str(refusal.status)).inc()
                events.warning(json.dumps({"event": "queue_refused", "key_id": record.key_id,
                                           "tenant": record.tenant, "model": model, "tier": tier,
                                           "status": refusal.status, "code": refusal.code, "reason": refusal.reason}))
                headers[QUEUE_WAIT_HEADER] = str(round((loop.time() - started) * 1000))
                return errors.queue_refused(refusal.status, refusal.code, refusal.message, refusal.retry_after_s,
                                            {QUEUE_WAIT_HEADER: headers[QUEUE_WAIT_HEADER]})
            except QueueUnavailable:
                self.metrics.redis_errors.labels(component="queue").inc()
                if self.settings.limiter_fail_mode == "closed":
                    await ticket.settle(NOTHING_BILLED)
                    return errors.limiter_unavailable()
                self.metrics.degraded.set(1)  # served without the model's capacity check
                return None
            except ClientGone:
                await ticket.settle(NOTHING_BILLED)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            except BaseException:
                await ticket.settle(NOTHING_BILLED)
                raise
            finally:
                waiting.dec()
            self.metrics.queue_admitted.labels(model=model, tenant=record.tenant).inc()
            self.metrics.queue_wait.labels(model=model, tier=tier).observe(slot.wait_s)
            headers[QUEUE_WAIT_HEADER] = str(round(slot.wait_s * 1000))
            return slot

        if not stream:
            return await wait_for_slot()
        outcome = asyncio.create_task(wait_for_slot())
        first_signal = asyncio.create_task(signals.get())
        try:
            await asyncio.wait({outcome, first_signal}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            outcome.cancel()
            raise
        finally:
            first_signal.cancel()
        if outcome.done():
            return outcome.result()
        headers[QUEUE_WAIT_HEADER] = str(round(first_signal.result() * 1000))  # so far: the stream opens now
        signals.put_nowait(first_signal.result())
        return PendingSlot(outcome, signals)

    async def _limited(self, call: Awaitable[Ticket | None], record: KeyRecord, from_cache: bool,
                       ticket: Ticket | None = None) -> tuple[Ticket | None, Response | None]:
        """Run one limiter phase: (the ticket, None) when it may go on, (ticket, the response) when not."""
        try:
            result = await call
        except LimiterOutOfMemory:
            self.metrics.redis_out_of_memory.labels(component="limiter").inc()
            return ticket, errors.limiter_unavailable()
        except LimiterUnavailable:
            return ticket, errors.limiter_unavailable()
        except LimiterBusy:
            return ticket, errors.gateway_busy()
        ticket = result if result is not None else ticket
        assert ticket is not None and ticket.decision is not None
        self.metrics.degraded.set(1 if from_cache or ticket.local_fallback else 0)
        self.metrics.observe_budgets(ticket)
        decision = ticket.decision
        if decision.refused is None:
            return ticket, None
        shadowed = decision.allowed
        self.metrics.rate_limited.labels(limit=decision.refused, mode="shadow" if shadowed else "enforced").inc()
        if shadowed:
            events.warning(json.dumps({"event": "shadow_rate_limited", "key_id": record.key_id,
                                       "tenant": record.tenant, "limit": decision.refused,
                                       "reserved": ticket.reserved}))
            return ticket, None
        if decision.refused == "monthly_budget":
            return ticket, errors.monthly_budget_exceeded(self._budget_usd(ticket), decision.retry_after_s,
                                                          rate_limit_headers(decision), scope=decision.scope or "key")
        return ticket, errors.rate_limited(decision.refused, self._limit_value(ticket), decision.retry_after_s,
                                           rate_limit_headers(decision), scope=decision.scope or "key")

    @staticmethod
    def _budget_usd(ticket: Ticket) -> Decimal:
        if ticket.decision is not None and ticket.decision.scope == "tenant" and ticket.spend is not None:
            return Decimal(ticket.spend.tenant_budget_nano_usd) / NANO_PER_USD
        return ticket.who.monthly_budget_usd or Decimal(0)

    def _limit_value(self, ticket: Ticket) -> int:
        decision, who = ticket.decision, ticket.who
        assert decision is not None and decision.refused is not None
        field = {"requests": "requests_per_minute", "tokens": "tokens_per_minute",
                 "concurrency": "max_concurrent_requests", "daily_tokens": "daily_token_budget"}[decision.refused]
        if decision.scope == "tenant":
            return getattr(ticket.tenant_limits, field) or 0
        if decision.scope == "shadow":
            return who.shadow_max_concurrent
        limit: int = getattr(who.limits, field)
        return limit


def upstream_request(document: dict[str, Any] | None, path: str, *, stream: bool, added_max_tokens: int | None,
                     priority: int | None = None) -> dict[str, Any] | None:
    """The body to send upstream (the same object when unchanged): streams always ask for usage
    in every chunk (so even a cut stream can be billed what it used), a completion without
    max_tokens gets the one its output bound needs (serving.gateway.metering.output_bound), and `priority`
    (the key's tier rank, for vLLM's priority scheduling) is set by the gateway alone: the body
    allowlist refuses one sent by a client (serving.gateway.admission.body)."""
    if document is None or path not in COMPLETION_PATHS:
        return document
    if stream:
        document = request_usage_upstream(document)
    if added_max_tokens is not None:  # the body sets no limit of its own (null included)
        document = {**document, "max_tokens": added_max_tokens}
    if priority is not None:
        document = {**document, "priority": priority}
    return document


def prompt_text(document: dict[str, Any]) -> str:
    """The prompt part of a body, for access logs of stacks that turn `log_prompts` on."""
    prompt = {k: document[k] for k in ("messages", "prompt", "input") if k in document}
    return json.dumps(prompt)[:PROMPT_LOG_CHARS]
