"""Gateway overhead benchmark: the same upstream stub reached directly, through the llmstack
gateway, and (when it is installed) through LiteLLM proxy, in one run, driven by `wrk`.

    python -m ops.benchmarks.gateway [--duration 15] [--litellm PATH_TO_litellm] [--out build/bench/gateway.json]

Measurements per target, all with 100 concurrent connections (clients):
- paced, at each of `--pace-ms` (default 1000, 500, 200): every client waits that long on
  average (exponentially distributed) between its requests, so 100 clients offer about 100,
  200 and 500 requests/s. Below saturation latency is
  service time, not queueing. Added latency = gateway - direct, at p50 and p99 (targets:
  <= 1 ms and <= 5 ms). Real LLM clients wait seconds per answer, so 100 of them offer far
  less than the stub-driven 500/s; the sweep shows where the target holds and where not.
- saturated: clients send back to back; requests/s is the most each target serves here.
The gateway runs twice: as is (no queued model) and with the fair queue on for the model at a
capacity the load never reaches (`gateway_queue`): what the queue costs a request that never waits.
The first is also measured behind the edge (`gateway_edge`: HAProxy on the public port, as a pod
and `make dev` run it): what that hop costs. And with tracing on (`gateway_traced`: the stack's
default sampling, or `--tracing-ratio`, exporting to an in-process OTLP receiver,
ops.devstack.trace_collector): what observability.tracing costs against tracing off (`gateway`).
Plus one client sending one request at a time to direct, both gateways and a gateway without
Redis, which splits the added latency into the proxy hop and the Redis round trips; and Redis
commands per request: what clients send (MONITOR), not what scripts run inside Redis;
and CPU milliseconds per request of the gateway's and LiteLLM's processes in the saturated run.

Everything runs on this machine: wrk, the stub (`ops.harness.stub_upstream`), redis-server and the
gateway share its cores, so absolute numbers are this machine's; the ratios are the result.
`wrk` comes from Debian (`apt-get install wrk`); Python load generators saturate first.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import redis

from infra.spec.schema import Edge
from ops.devstack.edge import start_edge
from ops.devstack.local_redis import start_redis
from ops.devstack.trace_collector import trace_collector
from ops.harness.processes import background, free_port, terminate, wait_for_http
from ops.harness.stub_gateway import GENEROUS, GatewayProcess, running_gateway, running_stub
from ops.harness.stub_upstream import CHAT_BODY as BODY
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.config.tracing_policy import DEFAULT_SAMPLING_RATIO

CONNECTIONS = 100
UNSATURATED = 1_000_000  # a model capacity no run here reaches
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60_000.0}


def parse_wrk(output: str) -> dict[str, float]:
    """Requests/s, latency percentiles (ms) and non-2xx/socket error counts from `wrk --latency`."""
    result: dict[str, float] = {}
    for pct, number, unit in re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.M):
        result[f"p{pct}_ms"] = float(number) * _UNITS[unit]
    match = re.search(r"Requests/sec:\s+([\d.]+)", output)
    result["requests_per_s"] = float(match.group(1)) if match else 0.0
    match = re.search(r"(\d+) requests in", output)
    result["requests"] = float(match.group(1)) if match else 0.0
    match = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    result["non_2xx"] = float(match.group(1)) if match else 0.0
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    result["socket_errors"] = float(sum(int(n) for n in errors.groups())) if errors else 0.0
    return result


def wrk_script(key: str, pace_ms: int) -> str:
    """wrk's Lua: the POST, the key, and (when pacing) a random wait between a client's
    requests, exponential with mean `pace_ms` (Poisson arrivals). A fixed wait would keep
    the 100 clients in lockstep: bursts of 100 requests at once, then silence."""
    lines = [
        'wrk.method = "POST"',
        f"wrk.body = {json.dumps(json.dumps(BODY))}",
        'wrk.headers["Content-Type"] = "application/json"',
        f'wrk.headers["Authorization"] = "Bearer {key}"',
    ]
    if pace_ms:
        lines += [
            "function init(args) math.randomseed(os.time() + math.floor(os.clock() * 1000000)) end",
            f"function delay() return math.floor(-math.log(1 - math.random()) * {pace_ms}) end",
        ]
    return "\n".join(lines) + "\n"


def run_wrk(url: str, key: str, *, duration_s: int, pace_ms: int, folder: Path) -> dict[str, float]:
    script = folder / f"wrk-{pace_ms}.lua"
    script.write_text(wrk_script(key, pace_ms))
    # --timeout: a slow target (LiteLLM answers in seconds at this load) is measured, not dropped.
    command = [
        "wrk",
        "-t2",
        f"-c{CONNECTIONS}",
        f"-d{duration_s}s",
        "--timeout",
        "30s",
        "--latency",
        "-s",
        str(script),
        f"{url}/v1/chat/completions",
    ]
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    return parse_wrk(output)


def tree_cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process and its children (LiteLLM forks a worker)."""
    if pid is None:
        return 0.0
    import psutil

    root = psutil.Process(pid)
    return sum(p.cpu_times().user + p.cpu_times().system for p in [root, *root.children(recursive=True)])


class RedisRoundTrips:
    """Counts the commands clients send to Redis (MONITOR), leaving out the ones scripts run
    inside Redis: those cost no round trip. Used around a separate short run, since MONITOR
    itself slows Redis down."""

    def __init__(self, url: str) -> None:
        self.url, self.count, self._stop = url, 0, threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with redis.Redis.from_url(self.url).monitor() as monitor:
            self._ready.set()
            for event in monitor.listen():
                if self._stop.is_set():
                    return
                if event.get("client_type") != "lua":
                    self.count += 1

    def __enter__(self) -> RedisRoundTrips:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        redis.Redis.from_url(self.url).ping()  # wakes the watcher so it sees the stop (not counted)
        self._thread.join(10)


def litellm_config(upstream: str) -> str:
    return json.dumps(
        {
            "model_list": [
                {
                    "model_name": "tiny",
                    "litellm_params": {"model": "openai/tiny", "api_base": f"{upstream}/v1", "api_key": "unused"},
                }
            ],
            "general_settings": {"master_key": "sk-bench-master"},
        }
    )


def run(
    duration_s: int, paces_ms: list[int], litellm: str | None, out: Path, tracing_ratio: float = DEFAULT_SAMPLING_RATIO
) -> dict:
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed: apt-get install -y wrk")
    folder = Path(tempfile.mkdtemp(prefix="llmstack-bench-gateway-"))
    results: dict = {
        "connections": CONNECTIONS,
        "duration_s": duration_s,
        "paces_ms": paces_ms,
        "tracing_ratio": tracing_ratio,
        "targets": {},
    }
    with ExitStack() as stack:
        own_redis = start_redis()
        stack.callback(own_redis.stop)
        stub = stack.enter_context(running_stub(folder / "stub.log")).url

        def gateway_with(log: str, settings: dict) -> GatewayProcess:
            return stack.enter_context(
                running_gateway(folder / log, upstream=stub, redis_url=own_redis.url, settings=settings)
            )

        gateway = gateway_with("gateway.log", {"models": ["tiny"]})
        # The same gateway with the fair queue on for the model, at a capacity no run here reaches:
        # what the queue costs a request that never waits.
        queued = gateway_with(
            "gateway-queue.log", {"models": ["tiny"], "model_queues": {"tiny": {"max_ongoing_requests": UNSATURATED}}}
        )
        # The first gateway again with tracing on, its spans to a receiver in this process.
        collector = stack.enter_context(trace_collector(folder / "spans.jsonl"))
        traced = gateway_with(
            "gateway-traced.log",
            {"models": ["tiny"], "tracing": {"otlp_endpoint": collector, "sampling_ratio": tracing_ratio}},
        )
        # The first gateway behind the edge, as a pod and `make dev` run it (ops.devstack.edge): what
        # the HAProxy hop costs. wrk's connections all come from one address: no per-address cap here.
        edge_port = free_port()
        edge = start_edge(
            Edge(max_connections_per_client=10 * CONNECTIONS),
            folder / "edge",
            port=edge_port,
            gateway_port=gateway.port,
            health_port=free_port(),
            request_timeout_s=600,
            shutdown_grace_s=5,
            log=folder / "edge.log",
        )
        stack.callback(terminate, edge, 5)
        key = create_key_sync(own_redis.url, "bench", "bench", limits=GENEROUS)
        targets = {
            "direct": (stub, "unused"),
            "gateway": (gateway.url, key),
            "gateway_queue": (queued.url, key),
            "gateway_edge": (f"http://127.0.0.1:{edge_port}", key),
            "gateway_traced": (traced.url, key),
        }
        pids = {
            "gateway": gateway.process.pid,
            "gateway_queue": queued.process.pid,
            "gateway_traced": traced.process.pid,
        }
        wait_for_http(f"http://127.0.0.1:{edge_port}/healthz", edge)
        results["sequential"] = sequential_breakdown(stack, folder, stub, targets["gateway"], targets["gateway_queue"])
        if litellm:
            litellm_port = free_port()
            config = folder / "litellm.yaml"
            config.write_text(litellm_config(stub))  # JSON is YAML
            process = stack.enter_context(
                background(
                    [litellm, "--config", str(config), "--port", str(litellm_port), "--num_workers", "1"],
                    folder / "litellm.log",
                )
            )
            wait_for_http(f"http://127.0.0.1:{litellm_port}/health/liveliness", process, timeout_s=300)
            targets["litellm"] = (f"http://127.0.0.1:{litellm_port}", "sk-bench-master")
            pids["litellm"] = process.pid
        for name, (url, target_key) in targets.items():
            print(f"==> {name}: warm-up, paced at {paces_ms} ms between a client's requests, saturated", flush=True)
            run_wrk(url, target_key, duration_s=3, pace_ms=0, folder=folder)  # warm pools and caches
            paced = {}
            for pace in paces_ms:
                paced[str(pace)] = run = run_wrk(url, target_key, duration_s=duration_s, pace_ms=pace, folder=folder)
                print(
                    f"    paced {pace} ms: p50 {run.get('p50_ms', 0):.2f} ms, p99 {run.get('p99_ms', 0):.2f} ms, "
                    f"{run['requests_per_s']:.0f} req/s, non-2xx {run['non_2xx']:.0f}",
                    flush=True,
                )
            cpu_before = tree_cpu_s(pids.get(name))
            saturated = run_wrk(url, target_key, duration_s=duration_s, pace_ms=0, folder=folder)
            if name in pids:  # CPU of the server's processes per request it served, saturated
                saturated["cpu_ms_per_request"] = round(
                    (tree_cpu_s(pids[name]) - cpu_before) * 1000 / max(saturated["requests"], 1), 3
                )
            print(
                f"    saturated: {saturated['requests_per_s']:.0f} req/s, non-2xx {saturated['non_2xx']:.0f}",
                flush=True,
            )
            with RedisRoundTrips(own_redis.url) as trips:
                counted = run_wrk(url, target_key, duration_s=3, pace_ms=max(paces_ms), folder=folder)
            results["targets"][name] = {
                "paced": paced,
                "saturated": saturated,
                "redis_commands_per_request": round(trips.count / counted["requests"], 3)
                if counted["requests"]
                else None,
            }
    results["summary"] = summary(results["targets"])
    direct_p50 = results["sequential"]["direct"]["p50_ms"]
    results["summary"]["one_client_added_p50_ms"] = {
        name: round(r["p50_ms"] - direct_p50, 3) for name, r in results["sequential"].items() if name != "direct"
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(json.dumps(results["summary"], indent=2))
    shutil.rmtree(folder, ignore_errors=True)
    return results


def sequential_breakdown(
    stack: ExitStack, folder: Path, stub: str, gateway: tuple[str, str], gateway_queue: tuple[str, str]
) -> dict:
    """One client, one request at a time (no queueing): direct, the gateway, the gateway with the
    fair queue on, and a gateway without Redis (in-memory keys and limits), so the latency the
    gateway adds splits into its proxy hop and its Redis round trips. 1,000 requests each,
    interleaved twice."""
    key_file = folder / "memory-gateway.key"
    memory = stack.enter_context(
        running_gateway(
            folder / "memory-gateway.log",
            upstream=stub,
            redis_url="",
            settings={"models": ["tiny"], "default_limits": GENEROUS},
            args=("--dev-key-file", str(key_file)),
        )
    )
    targets = {
        "direct": (stub, "unused"),
        "gateway": gateway,
        "gateway_queue": gateway_queue,
        "gateway_without_redis": (memory.url, key_file.read_text().strip()),
    }
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    for _ in range(2):
        for name, (url, key) in targets.items():
            runs[name].append(one_at_a_time(url, key, 1000))
    result = {name: min(values, key=lambda r: r["p50_ms"]) for name, values in runs.items()}
    print(
        "==> one client, one request at a time: "
        + ", ".join(f"{name} p50 {r['p50_ms']:.2f} ms" for name, r in result.items()),
        flush=True,
    )
    return result


def one_at_a_time(url: str, key: str, count: int, model: str = "tiny") -> dict[str, float]:
    """p50 and p99 (ms) of `count` chat completions for `model`, sent one after another."""
    latencies = []
    body = {**BODY, "model": model}
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            started = time.perf_counter()
            client.post(
                f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ).raise_for_status()
            latencies.append((time.perf_counter() - started) * 1000)
    latencies.sort()
    return {"p50_ms": round(latencies[count // 2], 3), "p99_ms": round(latencies[int(count * 0.99)], 3)}


def added(target: dict, direct: dict) -> dict[str, dict[str, float]]:
    """Per pace: the target's p50 and p99 minus the direct path's, in ms."""
    return {
        pace: {q: round(run[f"{q}_ms"] - direct["paced"][pace][f"{q}_ms"], 3) for q in ("p50", "p99")}
        for pace, run in target["paced"].items()
    }


def summary(targets: dict) -> dict:
    direct, gateway = targets["direct"], targets["gateway"]
    result = {
        "gateway_added_ms_by_pace": added(gateway, direct),
        "gateway_saturated_over_direct": round(
            gateway["saturated"]["requests_per_s"] / direct["saturated"]["requests_per_s"], 3
        ),
        "redis_commands_per_request": gateway["redis_commands_per_request"],
    }
    if "gateway_queue" in targets:  # the fair queue on an unsaturated model vs off, same run
        queued = targets["gateway_queue"]
        result["queue_saturated_over_no_queue"] = round(
            queued["saturated"]["requests_per_s"] / gateway["saturated"]["requests_per_s"], 3
        )
        result["queue_added_ms_by_pace"] = added(queued, gateway)
        result["queue_redis_commands_per_request"] = queued["redis_commands_per_request"]
    if "gateway_edge" in targets:  # the gateway behind the edge vs alone, same run
        edge = targets["gateway_edge"]
        result["edge_saturated_over_gateway"] = round(
            edge["saturated"]["requests_per_s"] / gateway["saturated"]["requests_per_s"], 3
        )
        result["edge_added_ms_by_pace"] = added(edge, gateway)
    if "gateway_traced" in targets:  # tracing on at the run's sampling vs off, same run
        traced = targets["gateway_traced"]
        result["tracing_saturated_over_off"] = round(
            traced["saturated"]["requests_per_s"] / gateway["saturated"]["requests_per_s"], 3
        )
        result["tracing_added_ms_by_pace"] = added(traced, gateway)
        cpu_on, cpu_off = traced["saturated"].get("cpu_ms_per_request"), gateway["saturated"].get("cpu_ms_per_request")
        if cpu_on and cpu_off:
            result["tracing_cpu_per_request_over_off"] = round(cpu_on / cpu_off, 3)
    if "litellm" in targets:
        result["gateway_over_litellm_saturated"] = round(
            gateway["saturated"]["requests_per_s"] / max(targets["litellm"]["saturated"]["requests_per_s"], 1e-9), 2
        )
        result["litellm_added_ms_by_pace"] = added(targets["litellm"], direct)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="Gateway overhead vs direct (and LiteLLM proxy) with wrk.")
    parser.add_argument("--duration", type=int, default=15, help="seconds per wrk run")
    parser.add_argument(
        "--pace-ms",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[1000, 500, 200],
        help="waits between one client's requests for the paced runs, comma-separated",
    )
    parser.add_argument("--litellm", help="path to a `litellm` executable (installed in its own venv)")
    parser.add_argument("--out", type=Path, default=Path("build/bench/gateway.json"))
    parser.add_argument(
        "--tracing-ratio",
        type=float,
        default=DEFAULT_SAMPLING_RATIO,
        help="sampling of the traced gateway (default: the stack file's default)",
    )
    args = parser.parse_args()
    run(args.duration, args.pace_ms, args.litellm, args.out, args.tracing_ratio)


if __name__ == "__main__":
    main()
