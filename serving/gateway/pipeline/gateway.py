"""The request path of the OpenAI routes, read top to bottom in `Gateway.handle`:

    route       serving.gateway.protocol.routes.resolve: an explicit allowlist, before any key check
    admit       serving.gateway.admission: authenticate, read the body, validate, reserve, limit,
                queue (each a stage of its own; refusals are values, `Refusal`)
    proxy       serving.gateway.upstream.proxy: the model's Serve application
    meter       serving.gateway.metering.usage_meter: the usage the upstream reported
    settle      the key's tokens, its concurrency slot and the model's slot, given back once

What an admitted request holds (the limiter's ticket, the model's slot, then the upstream
connection) is held by one exit stack: whichever way the request ends before its response is
handed over (a refusal, an upstream error, an exception, a cancelled task), the connection is
closed and the request settled exactly once, with nothing billed; a response that streams takes
the stack's place (`pop_all`) and does both when its relay ends. The Batch API's routes are
answered in process by whoever `own_routes` is; this module never imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from serving.gateway.admission.admitter import Admission, Admitter, first_byte_timeout
from serving.gateway.admission.body import BodyTimeout
from serving.gateway.admission.queue_wait import QUEUE_WAIT_HEADER, ClientLeft
from serving.gateway.auth.adapter_access import visible_adapters
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.metering.usage_meter import NOTHING_BILLED
from serving.gateway.protocol import errors
from serving.gateway.protocol.errors import Refusal
from serving.gateway.protocol.routes import MODELS, ApiRoute, RouteRefusal, resolve
from serving.gateway.queue.fair_queue import QueueTicket
from serving.gateway.telemetry import tracing
from serving.gateway.telemetry.access_log import caller_of
from serving.gateway.upstream.proxy import UpstreamProxy, UpstreamStream, listed_models
from serving.gateway.upstream.queued_stream import QueuedStream

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first": shows up as such in access logs


class OwnRoutes(Protocol):
    """Routes the gateway answers itself (the Batch API: serving.gateway.batch.api)."""

    async def handle(self, request: Request, route: ApiRoute) -> Response: ...


class Gateway:
    """The OpenAI routes' request path. `own_routes`: who answers the routes the gateway serves
    itself (None: nobody, and `own_routes_off` says why, as a 404)."""

    def __init__(
        self,
        settings: GatewaySettings,
        admitter: Admitter,
        proxy: UpstreamProxy,
        own_routes: OwnRoutes | None = None,
        own_routes_off: Refusal | None = None,
    ) -> None:
        self.settings, self.admitter, self.proxy = settings, admitter, proxy
        self.own_routes, self.own_routes_off = own_routes, own_routes_off

    async def handle(self, request: Request) -> Response:
        with tracing.stage(tracing.ROUTE):
            route = resolve(request.method, request.scope["path"], self.settings.models)
        if isinstance(route, RouteRefusal):  # before the key check: unknown paths cost no Redis call
            return route_refused(route, request)
        if route.handler is not None:  # answered here, nothing goes upstream
            return await self._answer_own(request, route)
        admission = await self._admit(request)
        if not isinstance(admission, Admission):
            return admission
        caller_of(request.scope).meter = admission.meter
        return await self._serve(request, route, admission)

    async def _answer_own(self, request: Request, route: ApiRoute) -> Response:
        if self.own_routes is None:
            assert self.own_routes_off is not None
            return errors.response_for(self.own_routes_off)
        try:
            return await self.own_routes.handle(request, route)
        except ClientDisconnect:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BodyTimeout:
            return errors.response_for(errors.body_timeout(self.settings.body_timeout_s))

    async def _admit(self, request: Request) -> Admission | Response:
        """The admission stages; a refusal answered with the time it waited in the queue (0 if none)."""
        try:
            admission = await self.admitter.admit(request)
        except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing charged
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BodyTimeout:
            admission = errors.body_timeout(self.settings.body_timeout_s)
        if isinstance(admission, ClientLeft):
            return Response(status_code=CLIENT_CLOSED_REQUEST, headers={QUEUE_WAIT_HEADER: "0"})
        if isinstance(admission, Refusal):
            return errors.response_for(admission.with_default_headers({QUEUE_WAIT_HEADER: "0"}))
        return admission

    async def _serve(self, request: Request, route: ApiRoute, admission: Admission) -> Response:
        """Proxy, meter and settle an admitted request."""
        async with AsyncExitStack() as held:
            # Settles the key and gives the model's slot back with nothing billed if this ends
            # before the response is handed over; a no-op once settled (`Admission.settle`).
            held.push_async_callback(admission.settle, NOTHING_BILLED)
            model, allowed_models = route.model, admission.key.allowed_models
            if model is not None and allowed_models is not None and model not in allowed_models:
                admission.meter.status = 404
                await admission.settle(NOTHING_BILLED)
                return errors.response_for(errors.model_not_found(model).with_headers(admission.headers))
            if admission.pending is not None:  # a stream still queued: answer now, keep it alive while it waits
                held.pop_all()  # the queued stream settles, whichever way its wait and relay end
                return QueuedStream(admission, lambda slot: self._forward(request, route, admission, slot))
            response = await self._forward(request, route, admission, held=held)
            if isinstance(response, UpstreamStream):
                held.pop_all()  # the relay settles and closes when it ends: finished, cut, failed or the client gone
                return response
            # An error, or a model list filtered for this key: billed what the meter says of it.
            admission.meter.no_answer(response.status_code)
            await admission.settle(admission.meter.billed_usage())
            response.headers.update(admission.headers)
            return response

    def _model_list(self, admission: Admission) -> Callable[[object], object] | None:
        """None (relayed as is) only for an unrestricted key on a stack without adapters, as before
        adapters: otherwise Ray's own adapter cards (bucket URIs in their metadata) are dropped."""
        if admission.key.allowed_models is None and not self.settings.model_adapters:
            return None
        return listed_for(self.settings, admission)

    async def _forward(
        self,
        request: Request,
        route: ApiRoute,
        admission: Admission,
        queued_slot: QueueTicket | None = None,
        *,
        held: AsyncExitStack | None = None,
    ) -> Response:
        """The proxy stage; `held` takes the upstream connection. A stream that waited in the queue
        with its response open (`queued_slot` its slot, maybe None) has sent its headers already,
        and gets a cold model's first-byte timeout."""
        queued = admission.pending is not None
        body, resume = admission.upstream(queued_slot) if queued else (admission.body, admission.resume)
        with tracing.stage(tracing.UPSTREAM_CONNECT):  # until the upstream's headers (an error: its whole body)
            return await self.proxy.forward(
                request,
                route,
                body,
                meter=admission.meter,
                settle=admission.settle,
                extra_headers={} if queued else admission.headers,
                model=admission.base,
                model_list=self._model_list(admission) if route.path == MODELS else None,
                first_byte_timeout_s=first_byte_timeout(self.settings, queued_slot)
                if queued
                else admission.first_byte_timeout_s,
                held=held,
                resume=resume,
            )


def listed_for(settings: GatewaySettings, admission: Admission) -> Callable[[object], object]:
    """How the model list is cut for this caller: the base models its key may use, and exactly the
    adapters its grants allow on them (serving.gateway.auth.adapter_access)."""
    bases = admission.key.allowed_models
    adapters = visible_adapters(
        bases if bases is not None else settings.models, settings.model_adapters, admission.adapter_grants
    )
    return lambda document: listed_models(document, bases, adapters)


def route_refused(refusal: RouteRefusal, request: Request) -> Response:
    if refusal.status == 405:
        return errors.response_for(
            errors.method_not_allowed(request.method).with_headers({"allow": ", ".join(refusal.allow)})
        )
    return errors.response_for(errors.not_found(request.scope["path"]))
