"""`make dev`: the whole serving path on this machine, from the `local` stack.

    client ─► edge (HAProxy, :8080) ─► gateway ─► HAProxy (Ray Serve) ─► CPU vLLM replicas (one app per model)
                                          │
                                        Redis (a private redis-server, or the gateway's in-memory store)

Models with LoRA adapters get them from a local S3 started first (ops.devstack.local_adapters), as
Ray Serve LLM loads adapters only from object storage.

The edge is the gateway pod's public port as `llmctl render` makes it (ops.devstack.edge): header
deadline, header size cap, connections per client address; the gateway listens behind it on loopback.

The Serve applications are deployed from the same serve config `llmctl render` puts in the
RayService's `serveConfigV2` (only the HTTP bind address differs: loopback and a free port
here), declaratively as KubeRay deploys it (see `ops.devstack.serve`), with the environment
the rendered pods get (`serving_env`). Everything started here
is stopped on Ctrl-C or SIGTERM, in reverse order; a second `make dev` while one runs says so
instead of failing on a busy port.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from infra.render.gateway import gateway_settings
from infra.render.serve_config import SERVING_PATH, ServingPath, route_prefix
from infra.spec.schema import CpuNodeGroup, ScalingPolicy, StackSpec
from infra.spec.stack_file import load_stack
from ops.devstack.edge import start_edge
from ops.devstack.local_adapters import LocalAdapterRefused, check_local_adapters, serve_adapters_locally
from ops.devstack.local_models import ensure_local_models
from ops.devstack.local_redis import LocalRedis, redis_server_path, start_redis
from ops.devstack.lock import AlreadyRunning, DevLock
from ops.devstack.serve import DEPLOY_TIMEOUT_S, haproxy_dir, local_serve_config, local_serving_env
from ops.devstack.trace_collector import trace_collector
from ops.harness.processes import PortClaims, die_with_parent, free_port, terminate, wait_for_http
from ops.paths import state_dir
from serving.autoscaling.gateway_queue import REDIS_URL_ENV as AUTOSCALING_REDIS_URL_ENV
from serving.gateway.config.tracing_policy import TracingPolicy

DEFAULT_GATEWAY_PORT = 8080
TRACE_FILE = "traces.jsonl"  # under the state folder: the local collector's spans (`llmctl trace`)
Say = Callable[[str], None]


def _say(message: str) -> None:
    print(f"[llmstack dev] {message}", file=sys.stderr, flush=True)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def ray_cpus(spec: StackSpec) -> int:
    """Logical CPUs for local Ray: what the stack's CPU node groups offer."""
    return sum(g.cpus_per_node * g.max_size for g in spec.node_groups if isinstance(g, CpuNodeGroup))


def start_ray_serve(
    spec: StackSpec,
    serve_port: int,
    say: Say,
    path: ServingPath = SERVING_PATH,
    haproxy_files: str | None = None,
    redis_url: str | None = None,
) -> dict[str, Any]:
    """Start local Ray and deploy the serve config declaratively, as KubeRay does; show
    progress. Returns how another process reaches this Ray (`llmctl status|scale`).
    `haproxy_files`: where HAProxy keeps its files (`ops.devstack.serve.haproxy_dir`).
    `redis_url`: the gateway's Redis, where Serve's controller reads the gateway queue of models
    scaled on saturation (serving.autoscaling.gateway_queue)."""
    # Before Ray is imported: Ray reads these at import, in this process and every one it starts.
    os.environ.update(local_serving_env(spec, path, haproxy_files or haproxy_dir()))
    if redis_url and any(m.autoscaling.policy is ScalingPolicy.SATURATION for m in spec.models):
        os.environ[AUTOSCALING_REDIS_URL_ENV] = redis_url
    import ray
    from ray import serve
    from ray.serve.schema import ServeDeploySchema

    from ops.devstack import serve as local_serve

    config = local_serve_config(spec, serve_port, path)
    ServeDeploySchema.model_validate(config)  # fail before starting Ray on a bad config
    say(f"starting Ray ({ray_cpus(spec)} logical CPUs, serving path {path.value}) ...")
    for noisy in ("ray", "ray.serve", "ray.llm", "httpx"):  # keep the terminal to our progress lines
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # The dashboard serves Ray's REST API, where the gateway reads each model's live replicas
    # (serving.gateway.queue.replica_feed), as it does from the head Service in the cluster. Loopback only.
    dashboard_port = free_port()
    ray.init(
        num_cpus=ray_cpus(spec),
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        dashboard_port=dashboard_port,
        object_store_memory=512 * 1024**2,
        logging_level="warning",
        log_to_driver=False,
    )
    # ray.init installs its own SIGTERM handler (it logs and aborts); put ours back so SIGTERM
    # stops everything in order, like Ctrl-C, even while the engines are still loading.
    _trap_signals()
    serve.start(proxy_location=config["proxy_location"], http_options=config["http_options"])
    local_serve.deploy(config)
    for app in config["applications"]:
        local_serve.wait_running(app["name"], timeout_s=DEPLOY_TIMEOUT_S, on_change=say)
    return {
        "ray_address": ray.get_runtime_context().gcs_address,
        "ray_auth_mode": os.environ.get("RAY_AUTH_MODE"),
        "serve_port": serve_port,
        "serving_path": path.value,
        "dashboard_url": f"http://127.0.0.1:{dashboard_port}",
    }


def ray_auth_token() -> str | None:
    """This Ray's token when token authentication is on (Ray 2.60 turns it on for a local
    `ray.init`): the dashboard's REST API wants it as a bearer token. Ray's own HTTP clients get
    the header the same way (ray/_private/authentication/http_token_authentication.py)."""
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled

    headers = {k.lower(): v for k, v in get_auth_headers_if_auth_enabled({}).items()}
    scheme, _, token = headers.get("authorization", "").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def start_gateway(
    spec: StackSpec,
    *,
    port: int,
    metrics_port: int,
    upstream: str,
    redis_url: str | None,
    dev_key_file: Path | None,
    path: ServingPath = SERVING_PATH,
    dashboard_url: str | None = None,
    dashboard_token: str | None = None,
) -> subprocess.Popen[bytes]:
    """The gateway as its own process, configured as the rendered Deployment configures it,
    but bound to loopback (/metrics and /readyz on `metrics_port`). With the in-memory store
    only the gateway itself can make a key, so it writes one to `dev_key_file` (mode 0600).
    With Redis, the Batch API keeps its files in this checkout's state folder (`batches/`)."""
    batches = f"file://{state_dir() / 'batches'}" if redis_url else None
    env = {
        **os.environ,
        "LLMSTACK_UPSTREAM_URL": upstream,
        "LLMSTACK_GATEWAY_SETTINGS": gateway_settings(
            spec, path=path, batch_storage_url=batches, serve_dashboard_url=dashboard_url or None
        ),
        "LLMSTACK_GATEWAY_HOST": "127.0.0.1",
        "LLMSTACK_GATEWAY_METRICS_HOST": "127.0.0.1",
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(metrics_port),
    }
    env.pop("LLMSTACK_REDIS_URL", None)
    env.pop("LLMSTACK_RAY_AUTH_TOKEN", None)
    if dashboard_token:
        env["LLMSTACK_RAY_AUTH_TOKEN"] = dashboard_token
    if redis_url:
        env["LLMSTACK_REDIS_URL"] = redis_url
    extra = ["--dev-key-file", str(dev_key_file)] if dev_key_file else []
    return subprocess.Popen([sys.executable, "-m", "serving.gateway", *extra], env=env, preexec_fn=die_with_parent)


def first_token(base_url: str, api_key: str, model: str) -> None:
    """One streamed chat completion through the gateway: proves the whole path serves."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True
    )
    for _ in stream:
        break
    stream.close()


def banner(base_url: str, api_key: str, models: list[str], store: str, metrics_url: str) -> str:
    model = models[0]
    return f"""
llmstack dev is serving {", ".join(models)}  (keys and limits: {store})

  base URL  {base_url}
  API key   {api_key}    (dev key, shown once; make a new one with every start)
  metrics   {metrics_url}/metrics, {metrics_url}/readyz    (the gateway's private port)

  curl {base_url}/chat/completions \\
    -H "Authorization: Bearer {api_key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32}}'

  python -c 'from openai import OpenAI; c = OpenAI(base_url="{base_url}", api_key="{api_key}"); \\
print(c.chat.completions.create(model="{model}", \\
  messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)'

Ctrl-C stops everything.
"""


def run(
    stack: str = "local",
    port: int = DEFAULT_GATEWAY_PORT,
    ready_json: bool = False,
    say: Say = _say,
    path: ServingPath = SERVING_PATH,
    trace: bool = False,
) -> int:
    """`trace`: receive every request's spans in process (ops.devstack.trace_collector) unless
    the stack file names a collector of its own (observability.tracing.otlp_endpoint)."""
    from serving.gateway.auth.keys import create_key_sync

    started = time.monotonic()
    spec = _local_stack(stack, say)
    if spec is None:
        return 2
    lock = DevLock()
    try:
        lock.acquire()
    except AlreadyRunning as exc:
        say(str(exc))
        return 1
    previous = _trap_signals()
    try:
        with ExitStack() as cleanup:
            cleanup.callback(lock.release)
            # Held until the gateway listens: Ray's processes, started in between, open
            # connections whose local ports could otherwise take one of ours.
            claims = PortClaims()
            cleanup.callback(claims.release)
            _claim_gateway_port(claims, port)
            stack_traced = spec.observability.tracing.enabled
            spec = _traced_locally(spec, cleanup, say, trace=trace)
            local_traces = spec.observability.tracing.otlp_endpoint if not stack_traced else None
            redis: LocalRedis | None = None
            if redis_server_path():
                redis = start_redis()
                cleanup.callback(redis.stop)
                say(f"redis-server on 127.0.0.1:{redis.port} (private, no persistence)")
            else:
                say(
                    "WARNING: redis-server is not installed: the gateway keeps keys and limits in its own "
                    "memory (one process only, lost on exit). Install it: apt-get install -y redis-server"
                )
            # Before Ray starts: its processes inherit the endpoint of the adapters' S3.
            os.environ.update(serve_adapters_locally(spec, cleanup, say))
            serve_port = claims.claim()
            haproxy_files = haproxy_dir()
            cleanup.callback(shutil.rmtree, haproxy_files, ignore_errors=True)
            cleanup.callback(_stop_ray, lambda: {redis.process.pid} if redis else set())
            ray_info = start_ray_serve(spec, serve_port, say, path, haproxy_files, redis.url if redis else None)
            redis_url = redis.url if redis else None
            key_file = None if redis_url else state_dir() / "dev-key"
            metrics_port, gateway_port, edge_health_port = claims.claim(), claims.claim(), claims.claim()
            metrics_url = f"http://127.0.0.1:{metrics_port}"
            gateway = start_gateway(
                spec,
                port=gateway_port,
                metrics_port=metrics_port,
                upstream=f"http://127.0.0.1:{serve_port}",
                redis_url=redis_url,
                dev_key_file=key_file,
                path=path,
                dashboard_url=ray_info["dashboard_url"],
                dashboard_token=ray_auth_token(),
            )
            cleanup.callback(terminate, gateway)
            edge_files = Path(haproxy_files) / "edge"
            edge = start_edge(
                spec.gateway.edge,
                edge_files,
                port=port,
                gateway_port=gateway_port,
                health_port=edge_health_port,
                request_timeout_s=spec.gateway.request_timeout_s,
                shutdown_grace_s=spec.gateway.shutdown_grace_s,
            )
            cleanup.callback(terminate, edge)
            if key_file:
                cleanup.callback(key_file.unlink, missing_ok=True)
            base_url = f"http://127.0.0.1:{port}/v1"
            wait_for_http(f"{metrics_url}/readyz", gateway, 60, ok=lambda r: r.status_code == 200)
            wait_for_http(f"http://127.0.0.1:{edge_health_port}/healthz", edge, 30)
            claims.release()
            if redis_url:
                api_key = create_key_sync(redis_url, tenant="dev", name="make-dev")
            else:
                assert key_file is not None  # the in-memory store's gateway wrote its key there
                api_key = key_file.read_text().strip()
            models = [m.model_name for m in spec.models]
            first_token(base_url, api_key, models[0])
            say(f"first token through the gateway {time.monotonic() - started:.0f} s after start")
            # `llmctl keys|status|scale --stack local` read it
            lock.record(
                base_url=base_url,
                metrics_url=metrics_url,
                redis_url=redis_url,
                stack=spec.name,
                trace_endpoint=local_traces,
                **ray_info,
            )
            print(banner(base_url, api_key, models, "redis-server" if redis else "in-memory", metrics_url), flush=True)
            if ready_json:
                serve_root = f"http://127.0.0.1:{serve_port}"
                print(
                    json.dumps(
                        {
                            "ready": True,
                            "base_url": base_url,
                            "api_key": api_key,
                            "metrics_url": metrics_url,
                            "serve_url": f"{serve_root}/v1",
                            "models": models,
                            # each model's own OpenAI base URL on Serve (direct path: its route prefix)
                            "model_urls": {
                                m.model_name: serve_root + route_prefix(m, path).rstrip("/") + "/v1"
                                for m in spec.models
                            },
                            "serving_path": path.value,
                            "redis_url": redis_url,
                            "dashboard_url": ray_info["dashboard_url"],
                            "pid": os.getpid(),
                        }
                    ),
                    flush=True,
                )
            while gateway.poll() is None and edge.poll() is None:
                time.sleep(1)
            which = gateway if gateway.poll() is not None else edge
            say(f"{'gateway' if which is gateway else 'edge (HAProxy)'} exited with {which.returncode}; stopping")
            return 1
    except KeyboardInterrupt:
        say("stopping (Serve stops the engines first) ...")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        say("stopped")


def _local_stack(stack: str, say: Say) -> StackSpec | None:
    """The local stack to run, its tiny models and adapters built and the adapters checked; None
    (after saying why) when it cannot run."""
    from infra.spec.stack_file import StackFileError

    try:
        spec = load_stack(stack)
    except StackFileError as exc:
        say(f"error: {exc}")
        return None
    if spec.cloud.provider != "local":
        say(
            f"error: stack {spec.name} is a cloud stack (cloud.provider {spec.cloud.provider}); "
            "make dev runs a local stack, e.g. STACK=local"
        )
        return None
    for folder in ensure_local_models(spec):
        say(f"built tiny model {folder}")
    try:
        check_local_adapters(spec)
    except LocalAdapterRefused as exc:
        say(f"error: {exc}")
        return None
    return spec


def _traced_locally(spec: StackSpec, cleanup: ExitStack, say: Say, *, trace: bool) -> StackSpec:
    """With `trace`, `spec` traced into a local receiver (stopped with `cleanup`), unless it names a collector."""
    if not trace:
        return spec
    if spec.observability.tracing.enabled:
        say(f"tracing to the stack's collector {spec.observability.tracing.otlp_endpoint}")
        return spec
    spans = state_dir() / TRACE_FILE
    spec = traced(spec, cleanup.enter_context(trace_collector(spans)))
    say(f"tracing every request: spans in {spans}; `llmctl trace <trace_id of an access line>` prints one")
    return spec


def traced(spec: StackSpec, otlp_endpoint: str) -> StackSpec:
    """`spec` with every request traced to `otlp_endpoint` (the local collector)."""
    tracing = TracingPolicy(otlp_endpoint=otlp_endpoint, sampling_ratio=1.0)
    return spec.model_copy(update={"observability": spec.observability.model_copy(update={"tracing": tracing})})


def _trap_signals() -> dict[int, Any]:
    return {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGINT)}


def _claim_gateway_port(claims: PortClaims, port: int) -> None:
    try:
        claims.claim(port)
    except OSError:
        raise SystemExit(
            f"[llmstack dev] port {port} is taken by another program; run `make dev PORT=<free port>`"
        ) from None


def _stop_ray(keep: Callable[[], set[int]] = set) -> None:
    """Stop Serve and Ray, then wait for every process Ray started to be gone.

    `ray.shutdown()` returns while its workers (and their vLLM engine processes) are still
    exiting, some already re-parented away from us; so take the list of our descendants
    first (less `keep()`, e.g. redis-server, which is stopped next), and wait for exactly
    those, killing any that outlive a grace period.
    """
    import psutil
    import ray

    if not ray.is_initialized():
        return
    spared = keep()
    started = [p for p in psutil.Process().children(recursive=True) if p.pid not in spared]
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=20)
        for process in alive:
            with suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(alive, timeout=5)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ops.devstack", description="Run a local stack (make dev).")
    parser.add_argument("--stack", default="local")
    parser.add_argument("--port", type=int, default=int(os.environ.get("PORT") or DEFAULT_GATEWAY_PORT))
    parser.add_argument("--ready-json", action="store_true", help="print one JSON line when ready (tests)")
    parser.add_argument(
        "--serving-path",
        choices=[p.value for p in ServingPath],
        default=SERVING_PATH.value,
        help="how requests reach the engines; the others than the default are for "
        "`python -m ops.benchmarks.serving --paths` to compare",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="trace every request into a local OTLP receiver (make dev TRACE=1); `llmctl trace ID` prints one",
    )
    args = parser.parse_args()
    sys.exit(run(args.stack, args.port, args.ready_json, path=ServingPath(args.serving_path), trace=args.trace))


if __name__ == "__main__":
    main()
