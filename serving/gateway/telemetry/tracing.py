"""One OpenTelemetry trace per request: a root span for the request, a child span per stage.

The root span (`RequestTracing`, the outermost ASGI middleware) starts a new trace for every
request, whatever `traceparent` the caller sent: the gateway is the security boundary, so a
client neither joins its request to a trace of its choosing nor forces sampling on (that would
let one caller flood the collector). Sampling is decided here once, at the stack's ratio; the
upstream request carries the decision in W3C `traceparent` (`inject_upstream`, OTel's
propagator), and Ray Serve and vLLM follow it (parent-based samplers), so a trace is whole or
absent. The stages of `Gateway.handle` open child spans with `stage(name)`.

Span attributes: route, method, status, tenant, key id, model, tier and, for a refusal, its
error code. Never the prompt, a header, the key or a query string.

Off (no `observability.tracing.otlp_endpoint`): no SDK is imported, no tracer provider
installed, the middleware is not mounted, and `stage` returns one shared no-op context manager
without calling OpenTelemetry at all (its API's no-op path still costs about 9 us a span here,
against a gateway budget of about a millisecond per request). On but unsampled: only the root
span's sampling decision and the `traceparent` header; stages make no span.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.config.tracing_policy import TracingPolicy

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

SERVICE_NAME = "llmstack-gateway"
TRACER_NAME = "llmstack.gateway"

# The stages of Gateway.handle, in the order a request meets them (serving.gateway.pipeline).
ROUTE = "route"
AUTHENTICATE = "authenticate"
READ_BODY = "read_body"
VALIDATE = "validate"
RESERVE = "reserve"
LIMIT = "limit"
QUEUE_WAIT = "queue_wait"
UPSTREAM_CONNECT = "upstream_connect"  # until the upstream's response headers
RELAY = "relay"  # the upstream's body to the client (a stream, or a whole answer)
SETTLE = "settle"
LOG = "log"  # the access line and the request's metrics, once the response has ended
STAGES = (ROUTE, AUTHENTICATE, READ_BODY, VALIDATE, RESERVE, LIMIT, QUEUE_WAIT, UPSTREAM_CONNECT, RELAY, SETTLE, LOG)

# W3C trace context only: baggage is a caller-controlled channel the engine has no use for.
TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
_PROPAGATOR = TraceContextTextMapPropagator()
_UNTRACED: AbstractContextManager[None] = nullcontext()
_ERROR_BODY_LIMIT = 4096  # the gateway's own error bodies are a few hundred bytes
_PROBES = ("/healthz", "/readyz")

_tracer: trace.Tracer | None = None  # None: tracing off, every call here is a no-op

RequestAttributes = Callable[[Scope], Mapping[str, AttributeValue]]


def install(policy: TracingPolicy, provider: TracerProvider | None = None) -> TracerProvider | None:
    """Turn tracing on for this process when `policy` says so: an SDK tracer provider that
    samples `sampling_ratio` of new traces and batches spans to the OTLP/HTTP endpoint. Tests pass
    their own `provider` (an in-memory exporter). Returns the provider to shut down at exit."""
    global _tracer
    if provider is None:
        if not policy.enabled:
            _tracer = None
            return None
        provider = _otlp_provider(policy)
    _tracer = provider.get_tracer(TRACER_NAME)
    return provider


def uninstall() -> None:
    """Tracing off again (tests; a process installs once)."""
    global _tracer
    _tracer = None


def _otlp_provider(policy: TracingPolicy) -> TracerProvider:
    # Imported here: a gateway with tracing off never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create({"service.name": SERVICE_NAME}),
        # Every root is the gateway's own (RequestTracing ignores callers' context), so the ratio
        # decides; ParentBased only keeps a stage's span with its request's decision.
        sampler=ParentBased(TraceIdRatioBased(policy.sampling_ratio)),
    )
    # Batched off the event loop (the processor's own thread); a full queue drops spans, never blocks.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=policy.traces_url)))
    return provider


def enabled() -> bool:
    return _tracer is not None


@dataclass
class _StageClock:
    """Where the request's last top-level stage ended. The stages directly under the request span
    are contiguous: each starts where the one before ended, so the time between two stages (the
    event loop busy with other requests, the process waiting for a CPU) counts in the stage it
    delayed, and the stages add up to the request's time in the gateway."""

    root: Span
    since_ns: int


_clock: ContextVar[_StageClock | None] = ContextVar("llmstack_stage_clock", default=None)


def stage(name: str) -> AbstractContextManager[Any]:
    """A child span of the request's trace around one stage; a no-op when tracing is off or the
    request is not sampled. An exception escaping the stage is recorded on its span."""
    tracer = _tracer
    current = trace.get_current_span()
    if tracer is None or not current.is_recording():
        return _UNTRACED
    clock = _clock.get()
    if clock is not None and clock.root is current:
        return _contiguous_stage(tracer, name, clock)
    return tracer.start_as_current_span(name)  # a stage inside a stage (settle within relay)


@contextmanager
def _contiguous_stage(tracer: trace.Tracer, name: str, clock: _StageClock) -> Iterator[Span]:
    with tracer.start_as_current_span(name, start_time=clock.since_ns, end_on_exit=False) as span:
        try:
            yield span
        finally:
            clock.since_ns = time.time_ns()
            span.end(end_time=clock.since_ns)


def untraced() -> AbstractContextManager[Any]:
    """The no-op stage, for a call that sometimes is no stage of its own (a second settle)."""
    return _UNTRACED


def inject_upstream(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers` for the upstream request with this request's trace context in place of any the
    caller sent (its `traceparent` may be in `forward_request_headers`). With tracing on it is
    sent sampled or not, so Ray Serve and vLLM follow the gateway's decision rather than make their own."""
    if _tracer is None:
        return headers
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return [(name, value) for name, value in headers if name not in TRACE_HEADERS] + list(carrier.items())


def current_trace_id() -> str | None:
    """The sampled trace this request belongs to, as the 32 hex digits collectors show; None when
    tracing is off or the request is not traced."""
    if _tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid or not context.trace_flags.sampled:
        return None
    return trace.format_trace_id(context.trace_id)


def refusal_code(body: bytes) -> str | None:
    """The `error.code` (else `error.type`) of one of the gateway's OpenAI error bodies."""
    try:
        error = json.loads(body[:_ERROR_BODY_LIMIT])["error"]
        code = error.get("code") or error.get("type")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return str(code)[:80] if code is not None else None


class RequestTracing:
    """The root span of every request on the public port (mounted only when tracing is on).
    `attributes(scope)`, read when the response has ended, names who called and what (handlers
    fill it in as the request goes: serving.gateway.telemetry.access_log.caller_of)."""

    def __init__(self, app: ASGIApp, attributes: RequestAttributes) -> None:
        self.app, self.attributes = app, attributes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = _tracer
        if tracer is None or scope["type"] != "http" or scope["path"] in _PROBES:
            await self.app(scope, receive, send)
            return
        # context=Context(): a new trace, never the caller's (module docstring).
        started = time.time_ns()
        span = tracer.start_span(scope["method"], context=Context(), kind=SpanKind.SERVER, start_time=started)
        with trace.use_span(span, end_on_exit=not span.is_recording(), record_exception=True):
            if not span.is_recording():
                await self.app(scope, receive, send)
                return
            _clock.set(_StageClock(span, started))
            with _response_noted(span, send) as noting_send:
                try:
                    await self.app(scope, receive, noting_send)
                finally:
                    # The span ends when the request does: describing it is bookkeeping after that.
                    ended = time.time_ns()
                    _describe(span, scope, self.attributes(scope))
                    span.end(end_time=ended)


@contextmanager
def _response_noted(span: Span, send: Send) -> Iterator[Send]:
    """`send`, noting the response's status and, for an error, the refusal's code on `span`: every
    refusal the gateway answers is one JSON body made by serving.gateway.protocol.errors, so
    reading the code back here covers every stage (and the Batch API) without a call at each."""
    status: list[int] = []

    async def noting_send(message: Message) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])
            span.set_attribute("http.response.status_code", message["status"])
        elif message["type"] == "http.response.body" and status and status[0] >= 400 and len(status) == 1:
            status.append(0)  # the first body chunk only
            code = refusal_code(message.get("body", b""))
            if code is not None:
                span.set_attribute("llmstack.refusal.code", code)
        await send(message)

    yield noting_send
    if status and status[0] >= 500:
        span.set_status(Status(StatusCode.ERROR))


def _describe(span: Span, scope: Scope, attributes: Mapping[str, AttributeValue]) -> None:
    route = attributes.get("http.route")
    if isinstance(route, str):
        span.update_name(f"{scope['method']} {route}")
    span.set_attribute("http.request.method", scope["method"])
    span.set_attributes({name: value for name, value in attributes.items() if value is not None})
