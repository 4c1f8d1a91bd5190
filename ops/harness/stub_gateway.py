"""The gateway on the stub upstream, as the gateway benchmarks run it: `ops.harness.stub_upstream`
on a free port, then `python -m serving.gateway` as its own process against it, each answering
before the caller gets it and stopped (SIGTERM, then SIGKILL) when the caller's block ends.

The caller brings Redis (its URL; "" runs the gateway without one): the local redis-server
lives in ops.devstack, above the harness.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ops.harness.processes import background, free_port, wait_for_http

# A benchmark key's limits: none a run reaches, so only what the benchmark measures decides.
GENEROUS = {
    "requests_per_minute": 10_000_000,
    "tokens_per_minute": 1_000_000_000,
    "daily_token_budget": 10**12,
    "max_concurrent_requests": 10_000,
}


@dataclass(frozen=True)
class StubUpstream:
    url: str
    process: subprocess.Popen


@dataclass(frozen=True)
class GatewayProcess:
    url: str
    port: int
    process: subprocess.Popen
    metrics_url: str  # /metrics and /readyz


@contextmanager
def running_stub(log: Path) -> Iterator[StubUpstream]:
    """The stub upstream on a free port of 127.0.0.1, once it answers /v1/models."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with background([sys.executable, "-m", "ops.harness.stub_upstream", "--port", str(port)], log) as process:
        wait_for_http(f"{url}/v1/models", process)
        yield StubUpstream(url, process)


def gateway_env(
    *, upstream: str, redis_url: str, port: int, settings: dict, metrics_port: int | None = None
) -> dict[str, str]:
    """The environment `python -m serving.gateway` reads: its upstream, Redis, API port, metrics
    port (a free one unless given) and settings (serving.gateway.config, as JSON)."""
    return {
        "LLMSTACK_UPSTREAM_URL": upstream,
        "LLMSTACK_REDIS_URL": redis_url,
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(metrics_port or free_port()),
        "LLMSTACK_GATEWAY_SETTINGS": json.dumps(settings),
    }


@contextmanager
def running_gateway(
    log: Path,
    *,
    upstream: str,
    redis_url: str,
    settings: dict,
    args: tuple[str, ...] = (),
    cwd: Path | None = None,
) -> Iterator[GatewayProcess]:
    """A gateway on free ports of 127.0.0.1 (its API and its metrics), with `settings` as
    LLMSTACK_GATEWAY_SETTINGS and `args` on its command line (e.g. `--dev-key-file`), once it
    answers /healthz. `cwd`: another checkout, whose `serving.gateway` then runs."""
    port, metrics_port = free_port(), free_port()
    env = gateway_env(upstream=upstream, redis_url=redis_url, port=port, settings=settings, metrics_port=metrics_port)
    url = f"http://127.0.0.1:{port}"
    with background([sys.executable, "-m", "serving.gateway", *args], log, env, cwd=cwd) as process:
        wait_for_http(f"{url}/healthz", process)
        yield GatewayProcess(url, port, process, f"http://127.0.0.1:{metrics_port}")
