"""The gateway's ASGI app: probes, and the OpenAI API admitted and proxied under /v1/.

    GET  /healthz       liveness: the process answers (never checks dependencies, so a Redis
                        outage does not make Kubernetes restart every gateway pod)
    GET  /readyz        readiness: the key store answers, else 503 with the reason
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
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.gateway import errors
from serving.gateway.access_log import AccessLogMiddleware, note_caller
from serving.gateway.admission import admit
from serving.gateway.keys import KeyStore
from serving.gateway.limits import Limiter
from serving.gateway.proxy import UpstreamProxy, UpstreamStream
from serving.gateway.settings import GatewaySettings

log = logging.getLogger("llmstack.gateway")

READY_CHECK_TIMEOUT_S = 2.0
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
    proxy = UpstreamProxy(settings)
    limiter = Limiter(settings.redis_url, settings.limiter_fail_mode)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        problem = await key_store_problem(key_store)
        if problem is not None:
            return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def openai_api(request: Request) -> Response:
        admission = await admit(request, key_store, limiter, settings)
        if isinstance(admission, Response):
            return admission
        note_caller(request.scope, admission.key)
        ticket = admission.ticket
        try:
            response = await proxy.forward(request, admission.body, meter=admission.meter, settle=ticket.settle,
                                           extra_headers=admission.headers)
        except BaseException:
            await ticket.settle(0)  # frees the concurrency slot; nothing was generated
            raise
        if not isinstance(response, UpstreamStream):  # an error before any upstream answer
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
            Route("/v1/{path:path}", openai_api, methods=["GET", "POST"]),
        ],
        middleware=[Middleware(AccessLogMiddleware)],
        exception_handlers={404: not_found, 405: method_not_allowed},
        lifespan=lifespan,
    )
