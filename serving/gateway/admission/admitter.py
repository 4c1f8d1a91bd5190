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
or one `Refusal`. Each step is a stage of its own (authenticate, limit_check, queue_wait; the
body and its checks in body, validation and media_urls); what a step took (the limiter's ticket,
a slot of the model) is held in one exit stack, so a refusal or a failure in any later step gives
each back exactly once, and an admitted request hands them to its `Admission`.

Redis outages: a key verified in the last `key_cache_ttl_s` is still accepted (keys.RecentlyVerifiedKeys)
and the limiter falls back as its fail mode says; either sets the `degraded` gauge. A busy
Redis pool is not an outage: 503 + Retry-After (serving.gateway.redis.client). Keys in shadow
mode are served when over their own limits, and the would-be refusal is logged and counted.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from serving.gateway.admission.authenticate import Authenticator, Caller
from serving.gateway.admission.body import BodyError, read_body_within, request_document
from serving.gateway.admission.limit_check import LimitCheck
from serving.gateway.admission.media_urls import check_media
from serving.gateway.admission.queue_wait import ClientLeft, PendingSlot, QueuePlace, QueueStage
from serving.gateway.admission.validation import check_request
from serving.gateway.auth.adapter_access import base_of, effective_patterns, served_to
from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.auth.keys import KeyStore
from serving.gateway.capacity.engine_priority import engine_priority, unknown_share_priority
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.limits.decision import rate_limit_headers
from serving.gateway.limits.limiter import Limiter, effective_limits
from serving.gateway.limits.tenants import TenantStore, TenantsUnavailable
from serving.gateway.limits.ticket import Ticket, Who
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.metering.reservation import COMPLETION_PATHS, Reservation, reserve
from serving.gateway.metering.usage_meter import (
    Usage,
    UsageMeter,
    client_usage_wishes,
    request_usage_upstream,
    wants_stream,
)
from serving.gateway.protocol import errors
from serving.gateway.protocol.errors import Refusal
from serving.gateway.queue.fair_queue import FairQueue, QueueTicket, SlotTry
from serving.gateway.redis.client import RedisBusy
from serving.gateway.resume.request import ResumableStream, resumable
from serving.gateway.telemetry import tracing
from serving.gateway.telemetry.access_log import caller_of
from serving.gateway.telemetry.metrics import GatewayMetrics

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
    model: str | None  # as the body names it: a base, or `<base>:<adapter>` (metered per adapter)
    ticket: Ticket
    headers: dict[str, str]
    meter: UsageMeter
    queue_ticket: QueueTicket | None = None  # the model's slot (serving.gateway.queue.fair_queue), when queued
    first_byte_timeout_s: float | None = None  # a cold model's start, instead of upstream_idle_timeout_s
    pending: PendingSlot | None = None  # a stream still waiting for its slot
    resume: ResumableStream | None = None  # a stream the relay may continue if its replica dies
    base: str | None = None  # the model whose Serve application, queue and capacity serve it (an adapter's base)
    adapter_grants: tuple[str, ...] = ()  # the key's effective adapter grants (GET /v1/models lists by them)
    # A stream still waiting for its slot: its upstream body and resume context once the slot is
    # known (the engine priority comes from the tenant's share when it took the slot).
    upstream_for_slot: Callable[[QueueTicket | None], tuple[bytes, ResumableStream | None]] | None = None

    def upstream(self, slot: QueueTicket | None) -> tuple[bytes, ResumableStream | None]:
        """The body to send upstream and the stream's resume context, for the slot it holds."""
        if self.upstream_for_slot is None:
            return self.body, self.resume
        return self.upstream_for_slot(slot)

    async def settle(self, billed: Usage) -> None:
        """End the request once: bill the key's usage and give the model's slot back, in one
        Redis round trip when Redis settles the ticket (the slot's release rides along)."""
        slot = self.queue_ticket if self.pending is None else self.pending.slot
        release = slot.release_call() if slot is not None else None
        with tracing.stage(tracing.SETTLE) if not self.ticket.settled else tracing.untraced():
            try:
                await self.ticket.settle(billed, along=release)
            finally:
                if slot is not None and release is not None:
                    await slot.finish_release(release)


def first_byte_timeout(settings: GatewaySettings, slot: QueueTicket | None) -> float | None:
    """A model that may have no replica gets its cold start as the upstream's idle timeout."""
    if slot is None or not slot.cold:
        return None
    return max(settings.upstream_idle_timeout_s, settings.model_queues[slot.model].cold_start_timeout_s)


def route_path(request: Request) -> str:
    """The path of the request's route. Admission runs only on a path `resolve` matched exactly,
    which holds only unreserved characters and `/`: the path as the server decoded it is the
    canonical path, with no need to build (and parse) Starlette's `request.url` for it."""
    path: str = request.scope["path"]
    return path


def requested_model(document: dict[str, Any] | None) -> str | None:
    """The `model` field of a request's JSON object; None when it names no model as a string."""
    model = document.get("model") if document is not None else None
    return model if isinstance(model, str) else None


def declares_small_body(headers: Mapping[str, str]) -> bool:
    declared = headers.get("content-length", "")
    return declared.isdigit() and int(declared) <= EARLY_READ_BYTES


def model_allowed(key: KeyRecord, model: str | None, *, has_body: bool, bases: Collection[str] = ()) -> bool:
    """Unrestricted keys may call anything. A restricted key's bodiless requests (GET /v1/models)
    are not model-scoped, but a body must name an allowed model: a body we cannot read a model
    from might still be one the upstream reads a model from. A key's `allowed_models` lists base
    models: a name addressing a served base's adapter (`<base>:...`, Ray's rule) is checked by its
    base, whether that adapter exists or not, so this 403 never tells which adapters exist."""
    if key.allowed_models is None:
        return True
    if model is None:
        return not has_body
    return base_of(model, bases) in key.allowed_models


def unknown_to_caller(model: str | None, settings: GatewaySettings, grants: Sequence[str]) -> bool:
    """Whether to refuse `model` as unknown to a caller holding adapter `grants`. A stack that
    lists its models refuses every other name itself (404 `model_not_found`): an unknown model,
    an adapter the stack does not serve and one the caller may not use all take this one path,
    so the answer (status, body, headers, and the work done) is the same for each. A gateway
    given no model list forwards what it cannot check (a bare test setup)."""
    if model is None or not settings.models:
        return False
    return served_to(model, settings.models, settings.model_adapters, grants) is None


def names_adapter(model: str | None, settings: GatewaySettings) -> bool:
    """Whether `model` addresses an adapter of a served base (`<base>:...`, whether that adapter
    exists or not, and whether that base has adapters or not, so the work done tells nothing), on
    a stack that serves adapters: the requests that need the caller's adapter grants."""
    if not settings.model_adapters or model is None or ":" not in model:
        return False
    return model.split(":", 1)[0] in settings.models


def reservation_for(
    document: dict[str, Any] | None, body_size: int, path: str, settings: GatewaySettings
) -> tuple[Reservation, int | None]:
    """What a request reserves at admission, and the max_tokens the gateway adds to it (None
    when the body sets its own): for online requests and batch lines alike."""
    context_length = settings.model_context_lengths.get(base_of(requested_model(document) or "", settings.models))
    output = output_bound(document, path, context_length=context_length, ceiling=settings.max_tokens_ceiling)
    reservation = reserve(
        document,
        body_size,
        path,
        output=output,
        context_length=context_length,
        template_tokens=settings.chat_template_tokens,
    )
    return reservation, output.added_max_tokens


@dataclass(frozen=True)
class _Read:
    """A body read whole and parsed once (None: a route that takes no body)."""

    body: bytes
    document: dict[str, Any] | None


@dataclass(frozen=True)
class _Served:
    """The model a request names, the base whose replicas serve it, and the caller's adapter grants."""

    model: str | None
    base: str | None
    grants: tuple[str, ...]


@dataclass(frozen=True)
class _Charged:
    """What the limiter charged: the ticket, and the slot its round trip's try took (if any)."""

    ticket: Ticket
    attempt: SlotTry | None
    slot: QueueTicket | None


@asynccontextmanager
async def _try_given_back_on_error(queue: FairQueue | None, attempt: SlotTry | None) -> AsyncIterator[None]:
    """When the limiter's round trip fails, whether the slot try it carried ran is unknown: give
    back whatever it may have taken (a slot nobody renews would otherwise wait for its lease)."""
    try:
        yield
    except BaseException:
        if queue is not None and attempt is not None:
            await queue.forget_try(attempt)
        raise


class Admitter:
    """Admission with what it needs: the key store (and its outage cache), the limiter, the
    settings, the metrics and the fair queue, each step a stage of its own."""

    def __init__(
        self,
        settings: GatewaySettings,
        key_store: KeyStore,
        limiter: Limiter,
        metrics: GatewayMetrics,
        queue: FairQueue | None = None,
        tenants: TenantStore | None = None,
    ) -> None:
        self.settings, self.key_store, self.limiter, self.metrics = settings, key_store, limiter, metrics
        self.queue, self.tenants = queue, tenants
        self.authenticator = Authenticator(key_store, metrics, settings.key_cache_ttl_s)
        self.limits = LimitCheck(metrics)
        self.queue_stage = QueueStage(settings, metrics, queue)

    async def authenticate(self, request: Request) -> Caller | Refusal:
        return await self.authenticator.authenticate(request)

    async def adapter_grants(
        self, record: KeyRecord, model: str | None, *, listing: bool = False
    ) -> list[str] | Refusal:
        """The caller's effective adapter grants (serving.gateway.auth.adapter_access), read only
        when they can matter, on a stack with adapters: a body naming `<served base>:...` (whether
        that adapter exists or not, so the work done tells nothing: `names_adapter`), or the model
        list (`listing`). The tenant's list is read from Redis when the key has none of its own:
        one GET. Unreadable: 503, the same for every such name."""
        settings = self.settings
        if not settings.model_adapters or not (listing or names_adapter(model, settings)):
            return []
        if record.allowed_adapters is not None or self.tenants is None:
            return effective_patterns(record.allowed_adapters, None)
        try:
            tenant = await self.tenants.adapters(record.tenant)
        except RedisBusy:
            return errors.gateway_busy()
        except TenantsUnavailable:
            self.metrics.redis_errors.labels(component="keys").inc()
            return errors.key_store_unavailable()
        return effective_patterns(None, tenant)

    async def admit(self, request: Request) -> Admission | Refusal | ClientLeft:
        with tracing.stage(tracing.AUTHENTICATE):
            caller = await self.authenticate(request)
        if isinstance(caller, Refusal):
            return caller
        async with AsyncExitStack() as held:
            ticket = None
            if request.method != "GET" and not declares_small_body(request.headers):
                with tracing.stage(tracing.LIMIT):
                    slot_phase = await self.limits.run(self.limiter.admit_slot(self._who(caller.record)), caller)
                if isinstance(slot_phase, Refusal):
                    return slot_phase
                ticket = slot_phase
                held.push_async_callback(ticket.release)  # a no-op once the ticket is settled or refused
            outcome = await self._admit_body(request, caller, ticket, held)
            if isinstance(outcome, Admission):
                held.pop_all()  # the admission holds the ticket and the slot now: settled when its response ends
            return outcome

    def _who(self, record: KeyRecord) -> Who:
        settings = self.settings
        return Who(
            key_id=record.key_id,
            tenant=record.tenant,
            limits=effective_limits(record, settings.default_limits),
            tenant_defaults=settings.default_tenant_limits,
            shadow=record.shadow,
            shadow_max_concurrent=settings.shadow_max_concurrent_requests,
            monthly_budget_usd=record.monthly_budget_usd,
        )

    async def admit_call(self, caller: Caller) -> Ticket | Refusal:
        """A call the gateway answers itself (the Batch API) counts against the key's and the
        tenant's requests per minute and concurrency like any request, so uploads and polling
        cannot flood the gateway: the ticket to settle when the call ends, or the refusal."""
        return await self.limits.run(self.limiter.admit_slot(self._who(caller.record)), caller)

    async def _admit_body(
        self, request: Request, caller: Caller, ticket: Ticket | None, held: AsyncExitStack
    ) -> Admission | Refusal | ClientLeft:
        with tracing.stage(tracing.READ_BODY):
            read = await self._read(request)
        if isinstance(read, Refusal):
            return read
        model = requested_model(read.document)
        caller_of(request.scope).model = model
        with tracing.stage(tracing.VALIDATE):  # the adapter grants are part of what a body may name
            grants = await self.adapter_grants(caller.record, model, listing=read.document is None)
            if isinstance(grants, Refusal):
                return grants
            refusal = self._validate(request, caller.record, model, read.document, grants)
        if refusal is not None:
            return refusal
        base = base_of(model, self.settings.models) if model is not None else None
        with tracing.stage(tracing.RESERVE):
            path = route_path(request)
            reservation, added_max_tokens = reservation_for(read.document, len(read.body), path, self.settings)
        with tracing.stage(tracing.LIMIT):
            charged = await self._charge(caller, model, base, reservation, ticket, held)
        if isinstance(charged, Refusal):
            return charged
        served = _Served(model, base, tuple(grants))
        with tracing.stage(tracing.QUEUE_WAIT):
            return await self._place(request, caller.record, served, read, reservation, added_max_tokens, charged)

    async def _read(self, request: Request) -> _Read | Refusal:
        """The read-body stage: within max_body_bytes, parsed once (the one parse, bounded)."""
        settings = self.settings
        body = await read_body_within(request, settings.max_body_bytes)
        if body is None:
            return errors.body_too_large(settings.max_body_bytes)
        document = request_document(body, route_path(request), settings)
        if isinstance(document, BodyError):
            return errors.invalid_request(document.param, document.message, document.code)
        return _Read(body, document)

    def _validate(
        self,
        request: Request,
        record: KeyRecord,
        model: str | None,
        document: dict[str, Any] | None,
        grants: Sequence[str],
    ) -> Refusal | None:
        """The validate stage: the key's models, then the request's fields and media URLs, before
        tokens are charged (a refusal costs none). A name the stack does not serve to this caller
        is refused after the field checks (so a malformed `model` is a 400 for every name)."""
        settings = self.settings
        if not model_allowed(record, model, has_body=document is not None, bases=settings.models):
            return errors.model_not_allowed(model)
        violation = check_request(document, route_path(request), settings)
        if violation is None and document is not None:
            if unknown_to_caller(model, settings, grants):
                assert model is not None
                return errors.model_not_found(model)
            base = base_of(model, settings.models) if model is not None else None
            violation = check_media(document, settings.media_domains(base))
        if violation is not None:
            return errors.invalid_request(violation.param, violation.message, violation.code)
        if settings.log_prompts and document is not None:
            caller_of(request.scope).prompt = prompt_text(document)
        return None

    async def _charge(
        self,
        caller: Caller,
        model: str | None,
        base: str | None,
        reservation: Reservation,
        ticket: Ticket | None,
        held: AsyncExitStack,
    ) -> _Charged | Refusal:
        """The limit stage with the reservation known. A queued model's free slot is asked for in
        the limiter's round trip, before its verdict: a refused request gives it straight back (a
        round trip on refusals only). The ledger keys on the name as requested (per adapter, for
        showback); the rate card and the queue on the base, whose replicas serve the adapter."""
        label = self.metrics.model_label(model)  # the ledger's model, bounded like the metrics'
        rate = self.settings.model_usd_per_million_tokens.get(self.metrics.model_label(base))
        attempt = self.queue_stage.slot_try(caller.record, base)
        along = attempt.call if attempt is not None else None
        async with _try_given_back_on_error(self.queue, attempt):
            if ticket is None:
                checked = await self.limits.run(
                    self.limiter.admit(
                        self._who(caller.record),
                        reservation.total,
                        along=along,
                        model=label,
                        usd_per_million_tokens=rate,
                    ),
                    caller,
                )
                if isinstance(checked, Ticket):
                    held.push_async_callback(checked.release)
            else:
                checked = await self.limits.run(
                    self.limiter.admit_tokens(
                        ticket, reservation.total, along=along, model=label, usd_per_million_tokens=rate
                    ),
                    caller,
                    ticket,
                )
        slot = self.queue.tried(attempt) if self.queue is not None and attempt is not None else None
        if slot is not None:
            held.push_async_callback(slot.discard)  # a no-op once the slot is released
        if isinstance(checked, Refusal):
            return checked
        return _Charged(checked, attempt, slot)

    async def _place(
        self,
        request: Request,
        record: KeyRecord,
        served: _Served,
        read: _Read,
        reservation: Reservation,
        added_max_tokens: int | None,
        charged: _Charged,
    ) -> Admission | Refusal | ClientLeft:
        """The queue stage, then the admission: the body to send upstream, the headers to answer
        with, the meter that bills it."""
        ticket, document, path = charged.ticket, read.document, route_path(request)
        assert ticket.decision is not None
        headers = rate_limit_headers(ticket.decision)
        if ticket.decision.refused is not None:  # allowed: a shadow key's would-be refusal
            headers = {name: value for name, value in headers.items() if name != "retry-after"}
        stream = wants_stream(document, path)
        final_usage, continuous_usage = client_usage_wishes(document) if document is not None else (True, True)
        place = await self.queue_stage.place(
            request, record, served.base, ticket, headers, stream=stream, attempt=charged.attempt, slot=charged.slot
        )
        if not isinstance(place, QueuePlace):
            return place

        def upstream_for(slot: QueueTicket | None) -> tuple[bytes, ResumableStream | None]:
            """What goes upstream: built once the slot is known, since its engine priority is."""
            upstream_document = upstream_request(
                document,
                path,
                stream=stream,
                added_max_tokens=added_max_tokens,
                priority=self._engine_priority(record, slot),
            )
            resume = self._resumable(upstream_document, path, stream=stream)
            if resume is not None:
                upstream_document = resume.document
            body = read.body if upstream_document is document else json.dumps(upstream_document).encode()
            return body, resume

        body, resume = upstream_for(place.slot)  # a stream still waiting: rebuilt when its slot comes
        meter = UsageMeter(
            stream=stream,
            reservation=reservation,
            client_final_usage=final_usage,
            client_continuous_usage=continuous_usage,
            client_chunk=None if resume is None else resume.client_chunk,
        )
        return Admission(
            key=record,
            body=body,
            model=served.model,
            base=served.base,
            adapter_grants=served.grants,
            ticket=ticket,
            headers=headers,
            meter=meter,
            queue_ticket=place.slot,
            first_byte_timeout_s=first_byte_timeout(self.settings, place.slot),
            pending=place.pending,
            resume=resume,
            upstream_for_slot=upstream_for if place.pending is not None else None,
        )

    def _resumable(self, document: dict[str, Any] | None, path: str, *, stream: bool) -> ResumableStream | None:
        """The resume context of a streamed completion, when the stack resumes streams."""
        if not self.settings.stream_resume.active or not stream or document is None:
            return None
        context_length = self.settings.model_context_lengths.get(
            base_of(requested_model(document) or "", self.settings.models)
        )
        bound = output_bound(document, path, context_length=context_length, ceiling=self.settings.max_tokens_ceiling)
        return resumable(document, path, stream=stream, bound=bound, settings=self.settings.stream_resume)

    def _engine_priority(self, record: KeyRecord, slot: QueueTicket | None) -> int | None:
        """vLLM's `priority` (lower runs first), when the stack enables it: the key's tier, then its
        tenant's share of the model when it took `slot` (serving.gateway.capacity.engine_priority).
        Without a known share (no queue for the model, Redis down in fail mode local, an admission
        learned late) the tier's last band: an unknown share never goes first."""
        policy = self.settings.queue
        if not policy.engine_priority:
            return None
        rank = policy.rank(record.tier)
        share = slot.share if slot is not None else None
        if share is None:
            return unknown_share_priority(rank)
        return engine_priority(
            rank, share.held, share.capacity, share.holders, weight=record.weight or 1.0, weights=share.weights
        )


def upstream_request(
    document: dict[str, Any] | None,
    path: str,
    *,
    stream: bool,
    added_max_tokens: int | None,
    priority: int | None = None,
) -> dict[str, Any] | None:
    """The body to send upstream (the same object when unchanged): streams always ask for usage
    in every chunk (so even a cut stream can be billed what it used), a completion without
    max_tokens gets the one its output bound needs (serving.gateway.metering.output_bound), and `priority`
    (from the key's tier and its tenant's share, for vLLM's priority scheduling) is set by the gateway alone: the body
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
