"""The gateway's two ASGI apps: the OpenAI API on the public port, metrics and readiness on another.

Public port (the Service publishes it):
    GET  /healthz       liveness: the process answers (never checks dependencies, so a Redis
                        outage does not make Kubernetes restart every gateway pod)
    the OpenAI routes   the request path, stage after stage: serving.gateway.pipeline.gateway
                        (route, admission, proxy, meter, settle), reached through the access
                        log and the body deadline alone (serving.gateway.http.public_app)
    /v1/files, /v1/batches  the Batch API, answered here (serving.gateway.batch); its workers run
                        each line through this same app, in process, at the lowest queue tier

Metrics port (settings.metrics_port; not published, reached by Prometheus and the kubelet):
    GET  /readyz, /metrics, /healthz   serving.gateway.http.probes

This module only wires: what runs is built by serving.gateway.http.services.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from opentelemetry.util.types import AttributeValue
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Scope

from serving.gateway.admission.body import BodyDeadline
from serving.gateway.auth.keys import KeyStore
from serving.gateway.batch.api import batches_unavailable
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.http import services
from serving.gateway.http.probes import Probes, healthz
from serving.gateway.http.public_app import PublicApp
from serving.gateway.pipeline.gateway import Gateway
from serving.gateway.protocol import errors
from serving.gateway.protocol.routes import ApiRoute, resolve
from serving.gateway.telemetry.access_log import MAX_MODEL_CHARS, REQUEST_ID_HEADER, AccessLogMiddleware, caller_of


@dataclass(frozen=True)
class GatewayApps:
    """`api` for the public port, `admin` for the metrics port. `api` owns the shared state
    (key store, limiter, upstream pool) through its lifespan; `admin` has none of its own."""

    api: PublicApp
    admin: Starlette


def create_app(settings: GatewaySettings, key_store: KeyStore) -> PublicApp:
    """The public app alone, for callers that serve no metrics port."""
    return create_apps(settings, key_store).api


def create_apps(settings: GatewaySettings, key_store: KeyStore) -> GatewayApps:
    """The apps own `key_store` from here on: `api` closes it (and its upstream pool) at shutdown."""
    running = services.build(settings, key_store)
    batch_off = services.batch_api_off(settings)
    gateway = Gateway(
        settings,
        running.admitter,
        running.proxy,
        own_routes=running.batch_api,
        own_routes_off=batches_unavailable(batch_off) if batch_off is not None else None,
    )
    probes = Probes(settings, key_store, running.metrics)
    access_log = Middleware(AccessLogMiddleware, metrics=running.metrics)
    not_found_handlers = {404: _not_found, 405: _method_not_allowed}
    # The public app's lifespan hands the batch workers the public app itself (`api`, bound by
    # the time the server starts the lifespan): their lines take the request path a client's take.
    tracing_on = settings.tracing.enabled
    api: PublicApp
    starlette = Starlette(
        routes=[Route("/healthz", healthz, methods=["GET"])],
        middleware=[access_log, Middleware(BodyDeadline, timeout_s=settings.body_timeout_s)],
        exception_handlers=not_found_handlers,
        lifespan=lambda _: running.lifespan(api),
    )
    api = PublicApp(
        starlette,
        gateway,
        running.metrics,
        settings.body_timeout_s,
        trace_attributes=trace_attributes(settings) if tracing_on else None,
    )
    admin = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            Route("/readyz", probes.readyz, methods=["GET"]),
            Route("/metrics", probes.prometheus, methods=["GET"]),
        ],
        middleware=[access_log],
        exception_handlers=not_found_handlers,
    )
    # PublicApp sends every HTTP request but /healthz to the gateway's request path, where
    # `resolve` decides (Starlette's own matching would redirect trailing slashes and know nothing
    # of encodings); Starlette here answers /healthz and the lifespan. No redirects on either port.
    for app in (starlette, admin):
        app.router.redirect_slashes = False
    return GatewayApps(api=api, admin=admin)


def trace_attributes(settings: GatewaySettings) -> Callable[[Scope], dict[str, AttributeValue]]:
    """What a request's root span says of it, read once its response has ended: the route as the
    allowlist names it (never the caller's spelling of an unknown path), and who called what."""

    def attributes(scope: Scope) -> dict[str, AttributeValue]:
        caller = caller_of(scope)
        route = resolve(scope["method"], scope["path"], settings.models)
        tier = settings.queue.tier(caller.tier).name if caller.key_id is not None else None
        request_id = next((v for n, v in scope["headers"] if n == REQUEST_ID_HEADER.encode()), b"")
        return {
            "http.route": _route_template(route) if isinstance(route, ApiRoute) else None,
            # the gateway's own id (the access log's and the response's x-request-id), never the caller's
            "llmstack.request_id": request_id.decode("latin-1") or None,
            "llmstack.tenant": caller.tenant,
            "llmstack.key_id": caller.key_id,
            "llmstack.model": caller.model[:MAX_MODEL_CHARS] if caller.model else None,
            "llmstack.tier": tier,
        }

    return attributes


def _route_template(route: ApiRoute) -> str:
    """The route with its model or object id as a placeholder, so span names stay few."""
    named = route.model or route.resource
    return route.path if named is None else route.path.replace(named, "{id}")


async def _not_found(request: Request, exc: Exception) -> Response:
    return errors.response_for(errors.not_found(request.scope["path"]))


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    refusal = errors.method_not_allowed(request.method)
    if isinstance(exc, HTTPException):  # Starlette's 405 always is one
        refusal = refusal.with_headers(exc.headers or {})  # keeps `Allow`
    return errors.response_for(refusal)
