"""Request ids and one JSON access-log line per request.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer nothing here
but adds a task per request): it sees the response status as it starts, and logs when the
response ends - for a stream, when the last chunk is sent or the client leaves - so latency
covers the whole answer. Handlers tell it who called through `caller_of(scope)`.

Logged: request id (always the gateway's own; the caller's x-request-id, if any, as
client_request_id), key_id, tenant, model, method, path, status, latency, tokens billed,
time to first token and, for a traced request, its trace id (serving.gateway.telemetry.tracing).
Never the key, headers or query string; the prompt only when the stack sets `log_prompts`
(prompts are the tenants' data). The same end-of-response point feeds the
Prometheus metrics (serving.gateway.telemetry.metrics).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.metering.usage_meter import Usage, UsageMeter
from serving.gateway.telemetry import tracing
from serving.gateway.telemetry.metrics import GatewayMetrics

log = logging.getLogger("llmstack.gateway.access")

REQUEST_ID_HEADER = "x-request-id"
_SCOPE_KEY = "llmstack.caller"
_MAX_REQUEST_ID_LENGTH = 128
MAX_MODEL_CHARS = 200
_PROBES = ("/healthz", "/readyz")  # polled every few seconds: log them only when they fail


@dataclass
class Caller:
    """What handlers learn about a request, for its log line and metrics."""

    key_id: str | None = None
    tenant: str | None = None
    tier: str | None = None  # the key's queue tier (None: the stack's default tier)
    model: str | None = None
    meter: UsageMeter | None = None  # set once admitted: tokens billed and time to first token
    prompt: str | None = None  # only when the stack turns log_prompts on


def caller_of(scope: Scope) -> Caller:
    """The record that handlers fill once a key is verified."""
    caller: Caller = scope.setdefault(_SCOPE_KEY, Caller())
    return caller


def note_caller(scope: Scope, key: KeyRecord) -> None:
    caller = caller_of(scope)
    caller.key_id, caller.tenant, caller.tier = key.key_id, key.tenant, key.tier


def client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The caller's own x-request-id, for the access line only, when it is short and printable
    (so it is safe to log); else None. It is never forwarded: vLLM and Ray Serve use the
    request id as the engine request's name, and one caller could reuse (and so collide with,
    or abort) another's."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if 0 < len(text) <= _MAX_REQUEST_ID_LENGTH and text.isascii() and text.isprintable():
                return text
    return None


def access_line(
    *,
    request_id: str,
    caller: Caller,
    method: str,
    path: str,
    status: int | None,
    latency_ms: float,
    usage: Usage | None = None,
    ttft_ms: float | None = None,
    client_request_id: str | None = None,
    trace_id: str | None = None,
) -> str:
    line = {
        "event": "access",
        "request_id": request_id,
        "client_request_id": client_request_id,
        "key_id": caller.key_id,
        "tenant": caller.tenant,
        # The model name comes from the body: cut, so a megabyte "model" cannot flood the log.
        "model": caller.model[:MAX_MODEL_CHARS] if caller.model else None,
        "method": method,
        "path": path,
        "status": status,
        "latency_ms": round(latency_ms, 1),
    }
    if usage is not None:
        line.update(prompt_tokens=usage.prompt, completion_tokens=usage.completion)
    if ttft_ms is not None:
        line["ttft_ms"] = round(ttft_ms, 1)
    if trace_id is not None:
        line["trace_id"] = trace_id
    if caller.prompt is not None:
        line["prompt"] = caller.prompt
    return json.dumps(line)


class AccessLogMiddleware:
    """Request ids, then one access line and the request's metrics when the response ends."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/metrics":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id, client_id = uuid.uuid4().hex, client_request_id(scope["headers"])
        # The handler (and so the upstream) sees exactly one x-request-id: ours.
        scope["headers"] = [(n, v) for n, v in scope["headers"] if n.lower() != REQUEST_ID_HEADER.encode()]
        scope["headers"].append((REQUEST_ID_HEADER.encode(), request_id.encode()))
        caller = caller_of(scope)
        status: int | None = None
        probe = scope["path"] in _PROBES

        async def send_with_request_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            await send(message)

        if not probe:
            self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_request_id)
        finally:
            with tracing.stage(tracing.LOG):
                self._ended(scope, caller, status, started, client_id, request_id, probe=probe)

    def _ended(
        self,
        scope: Scope,
        caller: Caller,
        status: int | None,
        started: float,
        client_id: str | None,
        request_id: str,
        *,
        probe: bool,
    ) -> None:
        """The request's metrics and its access line, once its response has ended."""
        elapsed_s = time.perf_counter() - started
        usage, ttft_s = _usage_and_ttft(caller, started)  # once, for both the metrics and the line
        if not probe:
            self.metrics.in_flight.dec()
            self._observe(caller, status, elapsed_s, usage, ttft_s)
        if not (probe and status == 200):
            log.info(
                access_line(
                    request_id=request_id,
                    caller=caller,
                    method=scope["method"],
                    path=scope["path"],
                    status=status,
                    latency_ms=elapsed_s * 1000,
                    usage=usage,
                    ttft_ms=None if ttft_s is None else ttft_s * 1000,
                    client_request_id=client_id,
                    trace_id=tracing.current_trace_id(),
                )
            )

    def _observe(
        self, caller: Caller, status: int | None, elapsed_s: float, usage: Usage | None, ttft_s: float | None
    ) -> None:
        m = self.metrics
        m.observe_request(status=status, model=caller.model, tenant=caller.tenant, duration_s=elapsed_s)
        if usage is not None:
            m.observe_tokens(model=caller.model, tenant=caller.tenant, prompt=usage.prompt, completion=usage.completion)
        if ttft_s is not None:
            m.ttft.labels(model=m.model_label(caller.model)).observe(ttft_s)


def _usage_and_ttft(caller: Caller, started: float) -> tuple[Usage | None, float | None]:
    """Tokens billed and seconds to the first generated text; None for what the request lacks."""
    meter = caller.meter
    if meter is None:
        return None, None
    ttft_s = None if meter.first_token_at is None else meter.first_token_at - started
    return meter.billed_usage(), ttft_s
