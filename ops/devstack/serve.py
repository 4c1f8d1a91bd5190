"""Ray Serve on the local Ray that `make dev` runs: deploy a Serve config, read its state.

`make dev` and `llmctl scale --stack local` deploy declaratively: the whole `ServeDeploySchema`
(the object a RayService's `serveConfigV2` holds) goes to the Serve controller, which
applies the difference. That is the path KubeRay takes in the cluster, and it is what makes
a change confined to an application's `deployments:` overrides (replica autoscaling) apply
in place instead of restarting the engines (see `infra.render.serve_config`).

The calls are the controller client's `deploy_apps` and `get_serve_details`, the same two
that Ray's REST API (`PUT`/`GET /api/serve/applications/`, used by KubeRay and `serve
deploy`) makes. We call them directly: the driver holds the controller, no HTTP needed. `make
dev` runs Ray's dashboard on loopback all the same, because the gateway reads live replica
counts from that REST API (serving.gateway.queue.replica_feed), as it does in the cluster.

Another process (llmctl) reaches the `make dev` Ray through the GCS address and Ray's
authentication mode that `make dev` records in its lock file.

The serving path's switches (`infra.render.serve_config.serving_env`) are environment
variables Ray reads at import time; `local_serving_env` adds what keeps two stacks on one
machine apart (HAProxy's stats and metrics ports, its config and socket files).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

from infra.render.serve_config import SERVING_PATH, ServingPath, serve_config, serving_env
from infra.spec.schema import StackSpec
from ops.harness.processes import free_port

TERMINAL_FAILURES = ("DEPLOY_FAILED", "UNHEALTHY")
DEPLOY_TIMEOUT_S = 900  # engines load in about a minute here; a stuck deploy must still end


def local_serve_config(spec: StackSpec, serve_port: int, path: ServingPath = SERVING_PATH) -> dict[str, Any]:
    """The rendered serve config, bound to loopback on a free port instead of 0.0.0.0:8000."""
    config = serve_config(spec, path=path)
    config["http_options"] = {"host": "127.0.0.1", "port": serve_port}
    return config


LOCAL_DRAIN_S = 2


def haproxy_dir() -> str:
    """A new private folder for HAProxy's files. Short on purpose: Ray puts them in a subfolder
    named by the 56-character node id, and HAProxy refuses socket paths over 97 bytes."""
    return tempfile.mkdtemp(prefix="llmhap-", dir="/tmp")


def local_serving_env(spec: StackSpec, path: ServingPath, haproxy_dir: str) -> dict[str, str]:
    """`serving_env` for a Ray on this machine: HAProxy's own ports moved to free ones and its
    files into `haproxy_dir` (see `haproxy_dir()`), so that a second stack, or a test, does not
    collide with this one.

    Also a short drain for the replicas that take HTTP themselves (direct ingress): Ray keeps
    such a replica draining at least RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (30 s in
    Ray 2.60) so that HAProxy on every node stops sending to it first. Locally one HAProxy
    watches one node, and that wait was most of a scale-down and of `make dev`'s stop."""
    env = serving_env(spec, path) | {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(LOCAL_DRAIN_S)}
    if "RAY_SERVE_ENABLE_HA_PROXY" in env:
        env |= {
            "RAY_SERVE_HAPROXY_STATS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(free_port()),
            "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": f"{haproxy_dir}/haproxy.cfg",
            "RAY_SERVE_HAPROXY_SOCKET_PATH": f"{haproxy_dir}/admin.sock",
            "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": haproxy_dir,
            "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": f"{haproxy_dir}/server-state",
            "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": f"{haproxy_dir}/metrics.sock",
        }
    return env


class ServeUnreachable(Exception):
    """The recorded Ray cluster does not answer (make dev stopped or crashed)."""


def connect(address: str, auth_mode: str | None) -> None:
    """Join the running local Ray as a driver (a few seconds; nothing is started)."""
    import logging

    if auth_mode:
        # A cluster started by ray.init() uses token auth with the token in ~/.ray; a client
        # must be in the same mode to present it, set before Ray reads its config at import.
        os.environ["RAY_AUTH_MODE"] = auth_mode
    import ray

    for noisy in ("ray", "ray.serve"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        ray.init(address=address, logging_level="error", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        raise ServeUnreachable(f"Ray at {address} does not answer ({type(exc).__name__})") from None


def deploy(config: dict[str, Any]) -> None:
    """Hand a Serve deploy config to the controller; returns once it is accepted."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(config))


def details() -> dict[str, Any]:
    """Serve's own report: applications, deployments, their configs and every replica
    (`ray.serve.schema.ServeInstanceDetails` as a dict)."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeInstanceDetails

    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        return {"applications": {}}
    # Validated and dumped as JSON types: enums become their plain values ("RUNNING").
    return ServeInstanceDetails.model_validate(client.get_serve_details()).model_dump(
        mode="json", exclude_unset=True, warnings=False
    )


def ray_nodes() -> list[dict[str, Any]]:
    """Ray's node table (`ray.nodes()`): each node's address, liveness and metrics export port."""
    import ray

    return list(ray.nodes())


def wait_running(
    app: str,
    *,
    timeout_s: float,
    on_change: Callable[[str], None],
    settled: Callable[[dict[str, Any]], bool] = lambda _: True,
) -> None:
    """Poll until `app` is RUNNING and `settled(app details)` holds; report each new state.

    Raises RuntimeError on DEPLOY_FAILED / UNHEALTHY and TimeoutError past `timeout_s`.
    """
    start, last, said = time.monotonic(), "", set[str]()
    while True:
        current = details().get("applications", {}).get(app)
        if current is not None:
            line = app_line(current)
            if line != last:
                on_change(f"[{time.monotonic() - start:5.0f} s] {app}: {line}")
                last = line
            for message in deployment_messages(current) - said:  # e.g. a replica waiting for CPUs
                on_change(f"        {message}")
                said.add(message)
            if current["status"] in TERMINAL_FAILURES:
                raise RuntimeError(f"Serve application {app!r} {current['status'].lower()}: {current['message']}")
            if current["status"] == "RUNNING" and settled(current):
                return
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"Serve application {app!r} not running after {timeout_s:.0f} s ({last})")
        time.sleep(1)


def app_line(app: dict[str, Any]) -> str:
    """`running (LLMServer:a: healthy, OpenAiIngress: healthy)`: one application's state."""
    states = ", ".join(f"{name}: {d['status'].lower()}" for name, d in sorted(app.get("deployments", {}).items()))
    status = app["status"].lower()
    return f"{status} ({states})" if states else status


ROUTINE_STATES = {"HEALTHY", "UPDATING", "UPSCALING", "DOWNSCALING"}


def deployment_messages(app: dict[str, Any]) -> set[str]:
    """Serve's explanations worth showing (first line of each): failures, and replicas that
    wait for resources ("... taken more than 30s to be scheduled ..."), not routine updates."""
    shown = set()
    for name, d in app.get("deployments", {}).items():
        message = (d.get("message") or "").strip()
        if message and (d.get("status") not in ROUTINE_STATES or "to be scheduled" in message):
            shown.add(f"{name}: {message.splitlines()[0][:300]}")
    return shown
