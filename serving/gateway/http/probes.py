"""The probes and the metrics endpoint of the metrics port (and /healthz of both ports).

GET  /healthz   liveness: the process answers (never checks dependencies, so a Redis outage
                does not make Kubernetes restart every gateway pod)
GET  /readyz    readiness: 200 "ready" when Redis answers; when it does not, 200 "degraded" if
                this replica can still serve (fail mode local), else 503 with the reason
GET  /metrics   Prometheus metrics (serving.gateway.telemetry.metrics): tenant names and usage
"""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serving.gateway.auth.keys import KeyStore
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.telemetry.metrics import CONTENT_TYPE_LATEST, GatewayMetrics

READY_CHECK_TIMEOUT_S = 2.0


async def key_store_problem(key_store: KeyStore) -> str | None:
    """Why the key store cannot serve admissions right now, or None when it can."""
    try:
        await asyncio.wait_for(key_store.ping(), READY_CHECK_TIMEOUT_S)
    except TimeoutError:
        return f"key store did not answer within {READY_CHECK_TIMEOUT_S} s"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready; the type is enough to diagnose
        return f"key store unreachable: {type(exc).__name__}"
    return None


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


class Probes:
    def __init__(self, settings: GatewaySettings, key_store: KeyStore, metrics: GatewayMetrics) -> None:
        self.key_store, self.metrics = key_store, metrics
        # While Redis is down, a replica can still serve (recently verified keys, local limits)
        # unless the stack chose fail mode `closed`. Reporting "not ready" then would make
        # Kubernetes pull every replica out of the Service at once: a full outage instead of a degraded one.
        self.serves_without_redis = settings.limiter_fail_mode == "local" and settings.key_cache_ttl_s > 0

    async def readyz(self, request: Request) -> Response:
        problem = await key_store_problem(self.key_store)
        if problem is None:
            self.metrics.degraded.set(0)  # Redis answers again: not degraded, even before the next admission
            return JSONResponse({"status": "ready"})
        self.metrics.degraded.set(1)
        if self.serves_without_redis and self.key_store.shared_across_processes:
            return JSONResponse(
                {"status": "degraded", "reason": problem, "serving": "recently verified keys, per-replica limits"}
            )
        return JSONResponse({"status": "unavailable", "reason": problem}, status_code=503)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
