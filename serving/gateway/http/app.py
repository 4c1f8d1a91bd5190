"""The gateway's two ASGI apps: the OpenAI API on the public port, metrics and readiness on another.

Public port (the Service publishes it):
    GET  /healthz       liveness: the process answers (never checks dependencies, so a Redis
                        outage does not make Kubernetes restart every gateway pod)
    the OpenAI routes   serving.gateway.protocol.routes: an explicit allowlist; anything else is 404/405
                        before any key check or upstream call. Then admission
                        (serving.gateway.admission.admitter: key, body, limits, a slot of the model's
                        capacity from the fair queue), the proxy, and settlement of the key's
                        tokens, its concurrency slot and the model's slot
    /v1/files, /v1/batches  the Batch API, answered here (serving.gateway.batch); its workers run
                        each line through this same app, in process, at the lowest queue tier

Metrics port (settings.metrics_port; not published, reached by Prometheus and the kubelet):
    GET  /readyz        readiness: 200 "ready" when Redis answers; when it does not, 200 "degraded"
                        if this replica can still serve (fail mode local), else 503 with the reason
    GET  /metrics       Prometheus metrics (serving.gateway.telemetry.metrics): tenant names and usage
    GET  /healthz       as above
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, request_response

from serving.gateway.admission.admitter import QUEUE_WAIT_HEADER, Admitter, first_byte_timeout
from serving.gateway.admission.body import BodyDeadline, BodyTimeout
from serving.gateway.auth.keys import KeyStore
from serving.gateway.batch.api import BatchApi, batches_unavailable
from serving.gateway.batch.runner import BatchRunner
from serving.gateway.batch.storage import storage_for
from serving.gateway.batch.store import BatchStore
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.limits.limiter import Limiter
from serving.gateway.metering.usage_meter import NOTHING_BILLED
from serving.gateway.protocol import errors
from serving.gateway.protocol.routes import RouteRefusal, resolve
from serving.gateway.queue.fair_queue import FairQueue, QueueTicket
from serving.gateway.queue.replica_feed import ReplicaFeed
from serving.gateway.redis.client import redis_client
from serving.gateway.telemetry.access_log import AccessLogMiddleware, caller_of
from serving.gateway.telemetry.metrics import CONTENT_TYPE_LATEST, GatewayMetrics
from serving.gateway.telemetry.redis_memory import watch_redis_memory
from serving.gateway.upstream.proxy import UpstreamProxy, UpstreamStream
from serving.gateway.upstream.queued_stream import QueuedStream

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
    except Exception as exc:  # noqa: BLE001 - any failure means not ready; the type is enough to diagnose
        return f"key store unreachable: {type(exc).__name__}"
    return None


@dataclass(frozen=True)
class GatewayApps:
    """`api` for the public port, `admin` for the metrics port. `api` owns the shared state
    (key store, limiter, upstream pool) through its lifespan; `admin` has none of its own."""

    api: Starlette
    admin: Starlette


def create_app(settings: GatewaySettings, key_store: KeyStore) -> Starlette:
    """The public app alone, for callers that serve no metrics port."""
    return create_apps(settings, key_store).api


# Complex on purpose: wiring plus the request path; the pipeline rework moves the handlers out.
def create_apps(settings: GatewaySettings, key_store: KeyStore) -> GatewayApps:  # noqa: C901
    """The apps own `key_store` from here on: `api` closes it (and its upstream pool) at shutdown."""
    metrics = GatewayMetrics(settings.models)
    metrics.set_prices(settings.model_usd_per_million_tokens)
    proxy = UpstreamProxy(settings, metrics)
    limiter = Limiter(settings.redis_url, settings.limiter_fail_mode, request_timeout_s=settings.request_timeout_s,
                      on_redis_error=metrics.redis_errors.labels(component="limiter").inc)
    # The fair queue shares each model's capacity across gateway replicas: without Redis there is
    # nothing to share it through, so an in-memory gateway forwards first come, first served.
    queue = (FairQueue(settings.redis_url, settings.queue, settings.model_queues)
             if settings.redis_url and settings.queue.enabled and settings.model_queues else None)
    admitter = Admitter(settings, key_store, limiter, metrics, queue)
    feed = (ReplicaFeed(settings.serve_dashboard_url, settings.model_deployments, queue.set_replicas,
                        poll_s=settings.replica_poll_s,
                        on_error=lambda kind: metrics.replica_feed_errors.labels(kind=kind).inc(),
                        token=settings.ray_auth_token.get_secret_value() if settings.ray_auth_token else None,
                        on_count=lambda model, n: metrics.model_replicas.labels(model=model).set(n))
            if queue is not None and settings.serve_dashboard_url and settings.model_deployments else None)
    batch_off = batch_api_off(settings)
    batch_api: BatchApi | None = None
    batch_redis = None
    if batch_off is None:
        assert settings.redis_url is not None and settings.batch_storage_url is not None
        # Its own pool: each worker holds a connection while it waits for lines.
        batch_redis = redis_client(settings.redis_url, decode_responses=True,
                                   max_connections=2 * settings.batch.workers + 16)
        batch_store, storage = BatchStore(batch_redis), storage_for(settings.batch_storage_url)
        runner = BatchRunner(settings, key_store, batch_store, storage, metrics)
        batch_api = BatchApi(settings, admitter, batch_store, storage, runner)
    # While Redis is down, a replica can still serve (recently verified keys, local limits)
    # unless the stack chose fail mode `closed`. Reporting "not ready" then would make
    # Kubernetes pull every replica out of the Service at once: a full outage instead of a degraded one.
    serves_without_redis = settings.limiter_fail_mode == "local" and settings.key_cache_ttl_s > 0

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        problem = await key_store_problem(key_store)
        if problem is None:
            metrics.degraded.set(0)  # Redis answers again: not degraded, even before the next admission
            return JSONResponse({"status": "ready"})
        metrics.degraded.set(1)
        if serves_without_redis and key_store.shared_across_processes:
            return JSONResponse({"status": "degraded", "reason": problem,
                                 "serving": "recently verified keys, per-replica limits"})
        return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)

    async def prometheus(request: Request) -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    # Complex on purpose: the request path in order; the pipeline rework splits it into stages.
    async def openai_api(request: Request) -> Response:  # noqa: C901
        route = resolve(request.method, request.scope["path"], settings.models)
        if isinstance(route, RouteRefusal):  # before the key check: unknown paths cost no Redis call
            return _refusal(route, request)
        if route.handler is not None:  # the Batch API: answered here, nothing goes upstream
            if batch_api is None:
                return batches_unavailable(batch_off or "")
            try:
                return await batch_api.handle(request, route)
            except ClientDisconnect:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            except BodyTimeout:
                return errors.body_timeout(settings.body_timeout_s)
        try:
            admission = await admitter.admit(request)
        except ClientDisconnect:  # gone while sending its body: nobody to answer, nothing charged
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except BodyTimeout:
            return errors.body_timeout(settings.body_timeout_s)
        if isinstance(admission, Response):
            admission.headers.setdefault(QUEUE_WAIT_HEADER, "0")
            return admission
        caller_of(request.scope).meter = admission.meter
        allowed_models = admission.key.allowed_models
        if route.model is not None and allowed_models is not None and route.model not in allowed_models:
            admission.meter.status = 404
            await admission.settle(NOTHING_BILLED)
            response: Response = errors.model_not_found(route.model)
            response.headers.update(admission.headers)
            return response
        # admission.settle bills the key and gives the model's queue slot back: exactly once,
        # whichever way the response ends (the relay's end, a cut, an upstream error, here).
        if admission.pending is not None:  # a stream still queued: answer now, keep it alive while it waits
            async def forward_when_admitted(slot: QueueTicket | None) -> Response:
                return await proxy.forward(request, route, admission.body, meter=admission.meter,
                                           settle=admission.settle, extra_headers={}, model=admission.model,
                                           allowed_models=allowed_models,
                                           first_byte_timeout_s=first_byte_timeout(settings, slot))

            return QueuedStream(admission, forward_when_admitted)
        try:
            response = await proxy.forward(request, route, admission.body, meter=admission.meter,
                                           settle=admission.settle, extra_headers=admission.headers,
                                           model=admission.model, allowed_models=allowed_models,
                                           first_byte_timeout_s=admission.first_byte_timeout_s)
        except BaseException:
            await admission.settle(NOTHING_BILLED)  # frees the concurrency and queue slots; nothing was generated
            raise
        if not isinstance(response, UpstreamStream):  # an error, or a model list filtered for this key
            admission.meter.no_answer(response.status_code)
            await admission.settle(admission.meter.billed_usage())
            response.headers.update(admission.headers)
        return response

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not key_store.shared_across_processes:
            log.warning(IN_MEMORY_WARNING)
        if queue is not None:
            await queue.start()
        if feed is not None:
            await feed.start()
        if batch_api is not None:
            await batch_api.runner.start(api)
        memory_redis = (redis_client(settings.redis_url, decode_responses=True, max_connections=1)
                        if settings.redis_url else None)
        watcher = (asyncio.create_task(watch_redis_memory(memory_redis, metrics))
                   if memory_redis is not None else None)
        log.info("gateway ready to proxy the OpenAI routes to %s", settings.upstream_url)
        try:
            yield
        finally:
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(BaseException):
                    await watcher
            if memory_redis is not None:
                await memory_redis.aclose()
            if batch_api is not None:
                await batch_api.runner.aclose()
                await batch_api.aclose()
            if batch_redis is not None:
                await batch_redis.aclose()
            if feed is not None:
                await feed.aclose()
            if queue is not None:
                await queue.aclose()
            await proxy.aclose()
            await limiter.aclose()
            await key_store.aclose()

    api = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
        ],
        middleware=[Middleware(AccessLogMiddleware, metrics=metrics),
                    Middleware(BodyDeadline, timeout_s=settings.body_timeout_s)],
        exception_handlers={404: _not_found, 405: _method_not_allowed},
        lifespan=lifespan,
    )
    admin = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", readyz, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
        ],
        middleware=[Middleware(AccessLogMiddleware, metrics=metrics)],
        exception_handlers={404: _not_found, 405: _method_not_allowed},
    )
    # Every other request, whatever its path and method, goes to `openai_api`, where `resolve`
    # decides (Starlette's own matching would redirect trailing slashes and know nothing of
    # encodings). No redirects on the metrics port either.
    api.router.default = request_response(openai_api)
    for app in (api, admin):
        app.router.redirect_slashes = False
    return GatewayApps(api=api, admin=admin)


def batch_api_off(settings: GatewaySettings) -> str | None:
    """Why this gateway serves no Batch API, or None when it does."""
    if not settings.batch.enabled:
        return "the stack turned it off (gateway.batch.enabled: false)."
    if not settings.redis_url:
        return "it keeps its state in Redis, and this gateway has none (LLMSTACK_REDIS_URL)."
    if not settings.batch_storage_url:
        return "it has nowhere to store files (batch_storage_url in LLMSTACK_GATEWAY_SETTINGS)."
    return None


def _refusal(refusal: RouteRefusal, request: Request) -> Response:
    if refusal.status == 405:
        response = errors.method_not_allowed(request.method)
        response.headers["allow"] = ", ".join(refusal.allow)
        return response
    return errors.not_found(request.scope["path"])


async def _not_found(request: Request, exc: Exception) -> Response:
    return errors.not_found(request.scope["path"])


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    response = errors.method_not_allowed(request.method)
    if isinstance(exc, HTTPException):  # Starlette's 405 always is one
        response.headers.update(exc.headers or {})  # keeps `Allow`
    return response
