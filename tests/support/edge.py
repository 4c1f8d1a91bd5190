"""The gateway's public port as `make dev` and the rendered pod run it: the edge (HAProxy, the
rendered configuration: infra.render.edge) on a free port, in front of a running gateway."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from infra.spec.schema import Edge
from ops.devstack.edge import start_edge
from ops.harness.processes import free_port, terminate, wait_for_http
from tests.support.servers import HANG_BOUND_S


@dataclass(frozen=True)
class PublicPort:
    url: str  # what clients reach
    health_url: str  # the edge's own /healthz (its liveness probe in the pod)
    process: subprocess.Popen


@contextmanager
def edge_in_front(api_url: str, edge: Edge, directory: Path, *, proxy_protocol: bool = False) -> Iterator[PublicPort]:
    port, health = free_port(), free_port()
    process = start_edge(
        edge,
        directory,
        port=port,
        gateway_port=urlsplit(api_url).port or 80,
        health_port=health,
        request_timeout_s=60,
        shutdown_grace_s=5,
        log=directory / "edge.log",
        proxy_protocol=proxy_protocol,
    )
    try:
        wait_for_http(f"http://127.0.0.1:{health}/healthz", process, HANG_BOUND_S)
        yield PublicPort(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{health}/healthz", process)
    finally:
        terminate(process, 5)
