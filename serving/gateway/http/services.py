"""What one gateway process runs, built from its settings (`build`), and started and stopped
with the public app (`lifespan`): the metrics, the upstream pool, the limiter, the fair queue,
its replica feed and the adaptive capacity it shares, the admitter, the Batch API with its
workers, Redis's memory watcher.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp

from serving.gateway.admission.admitter import Admitter
from serving.gateway.auth.adapter_access import served_adapters
from serving.gateway.auth.keys import KeyStore
from serving.gateway.batch.api import BatchApi
from serving.gateway.batch.runner import BatchRunner
from serving.gateway.batch.storage import storage_for
from serving.gateway.batch.store import BatchStore
from serving.gateway.capacity.store import AdaptiveCapacity
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.limits.limiter import Limiter
from serving.gateway.limits.tenants import TenantStore
from serving.gateway.queue.fair_queue import FairQueue
from serving.gateway.queue.replica_feed import ReplicaFeed
from serving.gateway.redis.client import redis_client, stop_loops
from serving.gateway.telemetry import tracing
from serving.gateway.telemetry.metrics import GatewayMetrics
from serving.gateway.telemetry.redis_memory import watch_redis_memory
from serving.gateway.upstream.proxy import UpstreamProxy

log = logging.getLogger("llmstack.gateway")

IN_MEMORY_WARNING = (
    "KEYS ARE IN MEMORY: no LLMSTACK_REDIS_URL is set, so this gateway uses its embedded key store. "
    "It works for ONE process only: keys are not shared with other replicas and vanish on restart. "
    "Set LLMSTACK_REDIS_URL for anything but a local trial."
)


def batch_api_off(settings: GatewaySettings) -> str | None:
    """Why this gateway serves no Batch API, or None when it does."""
    if not settings.batch.enabled:
        return "the stack turned it off (gateway.batch.enabled: false)."
    if not settings.redis_url:
        return "it keeps its state in Redis, and this gateway has none (LLMSTACK_REDIS_URL)."
    if not settings.batch_storage_url:
        return "it has nowhere to store files (batch_storage_url in LLMSTACK_GATEWAY_SETTINGS)."
    return None


@dataclass
class Services:
    settings: GatewaySettings
    key_store: KeyStore
    metrics: GatewayMetrics
    proxy: UpstreamProxy
    limiter: Limiter
    queue: FairQueue | None
    feed: ReplicaFeed | None
    capacity: AdaptiveCapacity | None
    admitter: Admitter
    batch_api: BatchApi | None
    batch_redis: Any  # redis.asyncio.Redis of the Batch API's own pool, when it runs

    @asynccontextmanager
    async def lifespan(self, api: ASGIApp) -> AsyncIterator[None]:
        """Start what runs beside the requests; at shutdown close everything the apps own."""
        settings = self.settings
        if not self.key_store.shared_across_processes:
            log.warning(IN_MEMORY_WARNING)
        # Installed here unless the caller (a test's in-memory exporter) already did; flushed at shutdown.
        tracer_provider = None if tracing.enabled() else tracing.install(settings.tracing)
        if tracer_provider is not None:
            log.info("tracing on: %.3g of requests to %s", settings.tracing.sampling_ratio, settings.tracing.traces_url)
        if self.queue is not None:
            await self.queue.start()
        if self.feed is not None:
            await self.feed.start()
        if self.capacity is not None:
            await self.capacity.start()
        if self.batch_api is not None:
            await self.batch_api.runner.start(api)
        memory_redis = (
            redis_client(settings.redis_url, decode_responses=True, max_connections=1) if settings.redis_url else None
        )
        watcher = (
            asyncio.create_task(watch_redis_memory(memory_redis, self.metrics)) if memory_redis is not None else None
        )
        log.info("gateway ready to proxy the OpenAI routes to %s", settings.upstream_url)
        try:
            yield
        finally:
            if watcher is not None:
                await stop_loops([watcher])
            if memory_redis is not None:
                await memory_redis.aclose()
            await self._close()
            if tracer_provider is not None:
                tracing.uninstall()
                await asyncio.to_thread(tracer_provider.shutdown)  # exports what is still batched

    async def _close(self) -> None:
        if self.batch_api is not None:
            await self.batch_api.runner.aclose()
            await self.batch_api.aclose()
        if self.batch_redis is not None:
            await self.batch_redis.aclose()
        if self.feed is not None:
            await self.feed.aclose()
        if self.capacity is not None:
            await self.capacity.aclose()
        if self.queue is not None:
            await self.queue.aclose()
        await self.proxy.aclose()
        await self.limiter.aclose()
        if self.admitter.tenants is not None:
            await self.admitter.tenants.aclose()
        await self.key_store.aclose()


def build(settings: GatewaySettings, key_store: KeyStore) -> Services:
    # Adapters are labelled (and ledgered) by their own served names: a bounded set, like the bases.
    metrics = GatewayMetrics([*settings.models, *served_adapters(settings.model_adapters)])
    metrics.set_prices(settings.model_usd_per_million_tokens)
    live: dict[str, int] = {}  # the replica feed's latest count per model
    capacity = _adaptive_capacity(settings, metrics, live)
    proxy = UpstreamProxy(settings, metrics, capacity.recorder if capacity is not None else None)
    limiter = Limiter(
        settings.redis_url,
        settings.limiter_fail_mode,
        request_timeout_s=settings.request_timeout_s,
        on_redis_error=metrics.redis_errors.labels(component="limiter").inc,
    )
    # The fair queue shares each model's capacity across gateway replicas: without Redis there is
    # nothing to share it through, so an in-memory gateway forwards first come, first served.
    queue = (
        FairQueue(
            settings.redis_url,
            settings.queue,
            settings.model_queues,
            adaptive=capacity.models if capacity is not None else (),
        )
        if settings.redis_url and settings.queue.enabled and settings.model_queues
        else None
    )
    # Tenants' adapter grants live in Redis (serving.gateway.limits.tenants); an in-memory gateway has
    # no tenant records, so only keys' own grants apply there.
    tenants = TenantStore(settings.redis_url) if settings.redis_url and settings.model_adapters else None
    admitter = Admitter(settings, key_store, limiter, metrics, queue, tenants)
    feed = _replica_feed(settings, metrics, queue, live)
    batch_api, batch_redis = None, None
    if batch_api_off(settings) is None:
        assert settings.redis_url is not None and settings.batch_storage_url is not None
        # Its own pool: each worker holds a connection while it waits for lines.
        batch_redis = redis_client(
            settings.redis_url, decode_responses=True, max_connections=2 * settings.batch.workers + 16
        )
        batch_store, storage = BatchStore(batch_redis), storage_for(settings.batch_storage_url)
        runner = BatchRunner(settings, key_store, batch_store, storage, metrics)
        batch_api = BatchApi(settings, admitter, batch_store, storage, runner)
    return Services(
        settings, key_store, metrics, proxy, limiter, queue, feed, capacity, admitter, batch_api, batch_redis
    )


def _adaptive_capacity(
    settings: GatewaySettings, metrics: GatewayMetrics, live: dict[str, int]
) -> AdaptiveCapacity | None:
    """The capacity of the queued models whose stack turned `latency_target.adaptive` on. It only
    acts through the fair queue (which holds the excess back), so without Redis or the queue
    there is none and every model keeps max_ongoing_requests per replica, as before."""
    if not settings.redis_url or not settings.queue.enabled:
        return None
    models = {
        model: capacity
        for model, capacity in settings.model_capacities.items()
        if capacity.adaptive and model in settings.model_queues
    }
    if not models:
        return None
    return AdaptiveCapacity(
        settings.redis_url,
        models,
        replicas=lambda model: live.get(model) or settings.model_queues[model].max_replicas,
        on_slots=lambda model, slots: metrics.model_capacity.labels(model=model).set(slots),
    )


def _replica_feed(
    settings: GatewaySettings, metrics: GatewayMetrics, queue: FairQueue | None, live: dict[str, int]
) -> ReplicaFeed | None:
    """Live replica counts for the queue's capacity, when the stack asks for them."""
    if queue is None or not settings.serve_dashboard_url or not settings.model_deployments:
        return None
    return ReplicaFeed(
        settings.serve_dashboard_url,
        settings.model_deployments,
        queue.set_replicas,
        poll_s=settings.replica_poll_s,
        on_error=lambda kind: metrics.replica_feed_errors.labels(kind=kind).inc(),
        token=settings.ray_auth_token.get_secret_value() if settings.ray_auth_token else None,
        on_count=lambda model, n: _counted(metrics, live, model, n),
    )


def _counted(metrics: GatewayMetrics, live: dict[str, int], model: str, replicas: int) -> None:
    metrics.model_replicas.labels(model=model).set(replicas)
    live[model] = replicas  # the adaptive capacity reads the merged in-flight peak per live replica
