"""Request ids and one JSON access-log line per request.

A pure ASGI middleware (not Starlette's BaseHTTPMiddleware, which would buffer nothing here
but adds a task per request): it sees the response status as it starts, and logs when the
response ends - for a stream, when the last chunk is sent or the client leaves - so latency
covers the whole answer. Handlers tell it who called through `caller_of(scope)`.

Logged: request id, key_id, tenant, method, path, status, latency. Never the key, headers,
query string or body: prompts are the tenants' data.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.key_format import KeyRecord

log = logging.getLogger("llmstack.gateway.access")

REQUEST_ID_HEADER = "x-request-id"
_SCOPE_KEY = "llmstack.caller"
_MAX_REQUEST_ID_LENGTH = 128
_PROBES = ("/healthz", "/readyz")  # polled every few seconds: log them only when they fail


@dataclass
class Caller:
    key_id: str | None = None
    tenant: str | None = None


def caller_of(scope: Scope) -> Caller:
    """The record that handlers fill once a key is verified."""
    return scope.setdefault(_SCOPE_KEY, Caller())


def note_caller(scope: Scope, key: KeyRecord) -> None:
    caller = caller_of(scope)
    caller.key_id, caller.tenant = key.key_id, key.tenant


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The caller's x-request-id when it is short and printable (so it is safe to log and
    forward), else a fresh one."""
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if 0 < len(text) <= _MAX_REQUEST_ID_LENGTH and text.isascii() and text.isprintable():
                return text
    return uuid.uuid4().hex


def access_line(*, request_id: str, caller: Caller, method: str, path: str, status: int | None,
                latency_ms: float) -> str:
    return json.dumps({
        "event": "access", "request_id": request_id, "key_id": caller.key_id, "tenant": caller.tenant,
        "method": method, "path": path, "status": status, "latency_ms": round(latency_ms, 1),
    })


class AccessLogMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        request_id = request_id_from(scope["headers"])
        # The handler (and so the upstream) sees exactly one x-request-id: ours.
        scope["headers"] = [(n, v) for n, v in scope["headers"] if n.lower() != REQUEST_ID_HEADER.encode()]
        scope["headers"].append((REQUEST_ID_HEADER.encode(), request_id.encode()))
        caller = caller_of(scope)
        status: int | None = None

        async def send_with_request_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(n, v) for n, v in message.get("headers", []) if n.lower() != REQUEST_ID_HEADER.encode()]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER.encode(), request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_request_id)
        finally:
            if not (status == 200 and scope["path"] in _PROBES):
                log.info(access_line(request_id=request_id, caller=caller, method=scope["method"],
                                     path=scope["path"], status=status,
                                     latency_ms=(time.perf_counter() - started) * 1000))
