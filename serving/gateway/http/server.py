"""Serve the gateway's two apps from one process: the API on `port`, metrics on `metrics_port`.

Both are uvicorn servers in one event loop, sharing the app state (metrics, key store). The
API server handles the signals: on SIGTERM it stops accepting, lets in-flight streams finish
(shutdown_grace_s), runs the lifespan shutdown; then the metrics server stops, so Prometheus
can scrape a draining pod to the end. Both sockets are bound before either serves, so a port
already in use fails the start at once, naming the port.

In a pod and in `make dev` the API port is on loopback behind the edge (HAProxy:
infra/render/edge.py), which bounds what clients without a key can hold before a request
reaches this server. `max_connections` becomes uvicorn's `limit_concurrency`: past that many connections (or
requests in progress) a new request is answered 503 without reaching the app, which with
`max_body_bytes` bounds what request bodies can hold in memory.

`run` is the process's: once the API server has started (the lifespan's services up, the socket
listening), it freezes the startup heap and raises the GC's generation-0 threshold
(serving.gateway.http.gc_tuning). A `GatewayServer` served in another process (tests) leaves
that process's collector alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator

import uvicorn

from serving.gateway.config.settings import GatewaySettings
from serving.gateway.http.app import GatewayApps
from serving.gateway.http.gc_tuning import tune_gc

API_KEEP_ALIVE_S = 75


class _MetricsServer(uvicorn.Server):
    """The second server: the API server owns the process's signal handlers."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _ApiServer(uvicorn.Server):
    """The API server: `on_started` runs once its startup is done."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None] | None) -> None:
        super().__init__(config)
        self.on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()


def api_config(apps: GatewayApps, settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(
        apps.api,
        host=settings.host,
        port=settings.port,
        # uvicorn counts the connection asking among the open ones (protocols/http/*_impl.py,
        # `len(self.connections) >= self.limit_concurrency`): +1 serves max_connections at once.
        limit_concurrency=settings.max_connections + 1,
        # Behind the edge only HAProxy keeps connections here, and it closes idle ones within
        # seconds (pool-purge-delay); uvicorn's 5 s default could close one just as HAProxy sends
        # a request on it (a 502 that no retry may fix: a POST is never retried).
        timeout_keep_alive=API_KEEP_ALIVE_S,
        # On SIGTERM: stop accepting, let in-flight streams finish for this long, then cancel them.
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        access_log=False,  # ours (JSON, with key_id and tenant) replaces uvicorn's
        log_config=None,  # keep the logging configured by the caller
        server_header=False,
        # HTTP only: with a WebSocket library installed (Ray brings one) uvicorn would hand an
        # Upgrade request to the app as a websocket scope, which nothing here serves (it was a 500).
        # Off, the upgrade is an ordinary HTTP request and gets the path's own answer.
        ws="none",
    )


def metrics_config(apps: GatewayApps, settings: GatewaySettings) -> uvicorn.Config:
    return uvicorn.Config(
        apps.admin,
        host=settings.metrics_host or settings.host,
        port=settings.metrics_port,
        lifespan="off",  # the shared state's lifespan is the API app's
        limit_concurrency=32,  # scrapes and probes: a handful at a time
        access_log=False,
        log_config=None,
        server_header=False,
        ws="none",
    )


def _bind(config: uvicorn.Config, what: str) -> socket.socket:
    try:
        return config.bind_socket()
    except SystemExit:  # uvicorn logs the OSError and exits; say which of the two ports it was
        raise OSError(f"cannot listen on {config.host}:{config.port} ({what})") from None


class GatewayServer:
    """The two servers of one gateway process. `serve()` runs until the API server stops (a
    signal, or `stop()`), then stops the metrics server. `on_started` runs once the API server
    has started."""

    def __init__(
        self, apps: GatewayApps, settings: GatewaySettings, on_started: Callable[[], None] | None = None
    ) -> None:
        self.api = _ApiServer(api_config(apps, settings), on_started)
        self.metrics = _MetricsServer(metrics_config(apps, settings))

    @property
    def started(self) -> bool:
        return self.api.started and self.metrics.started

    def stop(self) -> None:
        self.api.should_exit = True

    async def serve(self) -> None:
        api_socket = _bind(self.api.config, "port")
        metrics_socket = _bind(self.metrics.config, "metrics_port")
        metrics_task = asyncio.create_task(self.metrics.serve(sockets=[metrics_socket]))
        try:
            await self.api.serve(sockets=[api_socket])
        finally:
            self.metrics.should_exit = True
            await metrics_task


def run(apps: GatewayApps, settings: GatewaySettings) -> None:
    server = GatewayServer(apps, settings, on_started=lambda: tune_gc(settings.gc_gen0_threshold))
    # The event loop uvicorn.run would pick (uvloop when installed, as in the gateway image).
    with asyncio.Runner(loop_factory=server.api.config.get_loop_factory()) as runner:
        runner.run(server.serve())
