"""The public port's ASGI app: the request path reached through the layers it needs and no more.

Every request but /healthz goes to `Gateway.handle` (routes are its decision, not Starlette's:
serving.gateway.protocol.routes), so Starlette's router, exception middleware and request
wrapper had nothing to decide for them, yet took a share of the CPU per request (five nested
calls and three send wrappers). Here such a request passes only what acts on it: the access log,
the body deadline, and the last-resort 500. Starlette's app answers the rest as before: the
lifespan, /healthz (and its 404/405), any other scope type.

The same behaviour: the request path raises no HTTPException (the one thing Starlette's exception
middleware would have answered), and an exception escaping it is answered as Starlette's
ServerErrorMiddleware answers it: a plain-text 500 if no response started, outside the access
log (which logs the request with no status), then re-raised for uvicorn to log.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.admission.body import BodyDeadline
from serving.gateway.pipeline.gateway import Gateway
from serving.gateway.telemetry.access_log import AccessLogMiddleware
from serving.gateway.telemetry.metrics import GatewayMetrics
from serving.gateway.telemetry.tracing import RequestAttributes, RequestTracing

# Answered by the Starlette app (the probe route), not the request path.
STARLETTE_PATHS = frozenset({"/healthz"})


class PublicApp:
    """`starlette`: the app that runs the lifespan and answers /healthz; everything else is the
    request path of `gateway`, under the access log and the body deadline (`body_timeout_s`)."""

    def __init__(
        self,
        starlette: Starlette,
        gateway: Gateway,
        metrics: GatewayMetrics,
        body_timeout_s: float,
        *,
        trace_attributes: RequestAttributes | None = None,
    ) -> None:
        """`trace_attributes`: tracing is on; the request's root span goes outermost, so the access
        line inside it can carry the trace id (serving.gateway.telemetry.tracing)."""
        self.starlette, self._gateway = starlette, gateway
        request_path: ASGIApp = AccessLogMiddleware(BodyDeadline(self._handle, body_timeout_s), metrics=metrics)
        if trace_attributes is not None:
            request_path = RequestTracing(request_path, attributes=trace_attributes)
        self._request_path = request_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in STARLETTE_PATHS:
            await self.starlette(scope, receive, send)
            return
        started = False

        async def send_watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._request_path(scope, receive, send_watched)
        except Exception:
            if not started:
                await PlainTextResponse("Internal Server Error", status_code=500)(scope, receive, send)
            raise

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self._gateway.handle(Request(scope, receive, send))
        await response(scope, receive, send)
