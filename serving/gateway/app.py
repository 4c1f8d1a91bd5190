"""The gateway's ASGI app: probes, and the OpenAI API admitted and proxied under /v1/.

    GET  /healthz       liveness: the process answers (never checks dependencies, so a Redis
                        outage does not make Kubernetes restart every gateway pod)
    GET  /readyz        readiness: 200 "ready" when Redis answers; when it does not, 200 "degraded"
                        if this replica can still serve (fail mode local), else 503 with the reason
    GET  /metrics       Prometheus metrics (serving.gateway.metrics)
    GET|POST /v1/...    admission (serving.gateway.admission: key, body, limits), then the
                        proxy, then settlement of the key's tokens and concurrency slot
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.gateway import errors
from serving.gateway.access_log import AccessLogMiddleware, caller_of
from serving.gateway.admission import Admitter
from serving.gateway.keys import KeyStore
from serving.gateway.limits import Limiter
from serving.gateway.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from serving.gateway.proxy import UpstreamProxy, UpstreamStream
from serving.gateway.settings import GatewaySettings

log = logging.getLogger("llmstack.gateway")

READY_CHECK_TIMEOUT_S = 2.0
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first": shows up as such in access logs
IN_MEMORY_WARNING = (
    "KEYS ARE IN MEMORY: no LLMSTACK_REDIS_URL is set, so this gateway uses its embedded key store. "
    "It works for ONE process only: keys are not shared with other replicas and vanish on restart. "
    "Set LLMSTACK_REDIS_URL for anything but a local trial."
)


async def key_store_problem(key_store: KeyStore) -> str | None:
    """Why the key store cannot serve admissions right now, or None when it can."""
    try:
        await asyncio.wait_for(key_store.ping(), READY_CHECK_TIMEOUT_S)
    except TimeoutError:
        return f"key store did not answer within {READY_CHECK_TIMEOUT_S} s"
    except Exception as exc:  # any failure means not ready; the type is enough to diagnose
        return f"key store unreachable: {type(exc).__name__}"
    return None


def create_app(settings: GatewaySettings, key_store: KeyStore) -> Starlette:
    """The app owns `key_store` from here on: it closes it (and its upstream pool) at shutdown."""
    metrics = GatewayMetrics(settings.models)
    proxy = UpstreamProxy(settings, metrics)
    limiter = Limiter(settings.redis_url, settings.limiter_fail_mode, request_timeout_s=settings.request_timeout_s,
                      on_redis_error=metrics.redis_errors.labels(component="limiter").inc)
    admitter = Admitter(settings, key_store, limiter, metrics)
    # While Redis is down, a replica can still serve (recently verified keys, local limits)
    # unless the stack chose fail mode `closed`. Reporting "not ready" then would make
    # Kubernetes pull every replica out of the Service at once: a full outage instead of a degraded one.
    serves_without_redis = settings.limiter_fail_mode == "local" and settings.key_cache_ttl_s > 0

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        problem = await key_store_problem(key_store)
        if problem is None:
            return JSONResponse({"status": "ready"})
        metrics.degraded.set(1)
        if serves_without_redis and key_store.shared_across_processes:
            return JSONResponse({"status": "degraded", "reason": problem,
                                 "serving": "recently verified keys, per-replica limits"})
        return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def openai_api(request: Request) -> Response:
        try:
            admission = await admitter.admit(request)
        except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing charged
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(admission, Response):
            return admission
        caller_of(request.scope).meter = admission.meter
        ticket = admission.ticket
        try:
            response = await proxy.forward(request, admission.body, meter=admission.meter, settle=ticket.settle,
                                           extra_headers=admission.headers, model=admission.model)
        except BaseException:
            await ticket.settle(0)  # frees the concurrency slot; nothing was generated
            raise
        if not isinstance(response, UpstreamStream):  # an error before any upstream answer
            admission.meter.status = response.status_code  # bills nothing
            await ticket.settle(0)
            response.headers.update(admission.headers)
        return response

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return errors.not_found(request.url.path)

    async def method_not_allowed(request: Request, exc: HTTPException) -> Response:
        response = errors.method_not_allowed(request.method)
        response.headers.update(exc.headers or {})  # keeps `Allow`
        return response

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not key_store.shared_across_processes:
            log.warning(IN_MEMORY_WARNING)
        log.info("gateway ready to proxy /v1/ to %s", settings.upstream_url)
        try:
            yield
        finally:
            await proxy.aclose()
            await limiter.aclose()
            await key_store.aclose()

    return Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/v1/{path:path}", openai_api, methods=["GET", "POST"]),
        ],
        middleware=[Middleware(AccessLogMiddleware, metrics=metrics)],
        exception_handlers={404: not_found, 405: method_not_allowed},
        lifespan=lifespan,
    )
