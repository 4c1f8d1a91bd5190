"""Autoscaling, demonstrated: a model with min 1 / max 2 replicas on a two-node Ray cluster
scales up under `llmctl bench` load, survives a killed replica (or a killed worker node), and
scales back down.

    python -m ops.benchmarks.autoscale_demo [--out build/bench/autoscale.json] \
        [--stack tests/stacks/Pulumi.autoscale.yaml] [--through-gateway] [--kill replica|node]

1. Starts a Ray cluster of `max_size` nodes of the stack's CPU node group (`ray start --head`,
   then `ray start --address`, each on its own free ports and temp dir, with a private
   auth token), and deploys the stack's serve config (Ray Serve LLM, CPU vLLM) on it.
2. Drives open-loop load (Poisson arrivals, `--rate`) with the bench library (`ops.llmctl.bench.loadgen`,
   the `llmctl bench` engine) straight at Ray Serve, or with `--through-gateway` through the
   real gateway (`python -m serving.gateway`, the stack's settings, its `gateway.stream_resume`,
   a private redis-server and a key of its own) in front of Serve, and samples the model's
   replicas by state every second. Open loop at a moderate rate, not a saturating closed loop:
   on 2 cores an engine serving flat out leaves little CPU for the second replica's engine to start.
3. Once two replicas run and `--kill-in-flight` streams are open, SIGKILLs the process of the
   busiest replica (its tree's CPU over half a second; its vLLM engine goes with it) while load
   continues, or with `--kill node` every process of the Ray worker node hosting the busiest
   replica on a worker node at once (as a reclaimed machine dies; a new worker node then joins, as the node
   autoscaler would bring one), and waits for Serve to replace the replica.
4. Stops the load and waits for the scale-down to one replica.
Writes every sample, event and request outcome plus the findings (`ops.benchmarks.autoscale_timeline`:
cut streams, the pause the streams in flight at the kill showed their client) and, through the
gateway, its resume counters over the run (`ops.benchmarks.resume_metrics`) to the JSON file,
then stops everything it started, by process id. Evidence, not a test: it takes a few minutes
and its timings depend on the machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any, Literal

import psutil

from infra.render.gateway import gateway_settings
from infra.render.serve_config import SERVING_PATH, app_name, route_prefix
from infra.spec.schema import CpuNodeGroup, StackSpec
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.benchmarks.autoscale_timeline import Sample, findings
from ops.benchmarks.replicas import replica_processes, tree_cpu_s
from ops.benchmarks.resume_metrics import counter_deltas, resume_counters
from ops.devstack import serve as local_serve
from ops.devstack.local_redis import start_redis
from ops.devstack.serve import (  # make dev's deploy path
    DEPLOY_TIMEOUT_S,
    haproxy_dir,
    local_serve_config,
    local_serving_env,
)
from ops.harness.processes import free_port, stop_tree
from ops.harness.stub_gateway import GENEROUS, GatewayProcess, running_gateway
from ops.llmctl.bench.loadgen import LoadSpec, run_level, schedule
from ops.llmctl.bench.stats import LengthDistribution, RequestResult, summarise
from serving.gateway.auth.keys import create_key_sync

DEFAULT_STACK = "tests/stacks/Pulumi.autoscale.yaml"
# vLLM CPU pins each engine's worker to core 0 by default (VLLM_CPU_OMP_THREADS_BIND=auto
# binds rank 0 to the first core of its NUMA node and reserves the rest). Right for one
# engine per pod; on this one host both replicas' engines landed on core 0, and the second
# engine took 8-10 minutes to start beside the first serving on the same core (two runs; taskset
# showed affinity 0 for both). Unpinned, the OS spreads them over both cores.
ENGINE_ENV_ON_SHARED_HOST = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
Kill = Literal["replica", "node"]
RAY_PORT_FLAGS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)


def say(message: str) -> None:
    print(f"[autoscale-demo] {message}", file=sys.stderr, flush=True)


def ray_start_command(head_port: int, cpus: int, temp_dir: Path | None) -> list[str]:
    """`ray start --block` for one node: the head when `temp_dir` is given, else a worker.
    Every port is a free one so the demo runs beside other Ray clusters on the machine."""
    ray = str(Path(sys.executable).with_name("ray"))
    ports = [arg for flag in RAY_PORT_FLAGS for arg in (flag, str(free_port()))]
    common = [
        "--block",
        "--num-cpus",
        str(cpus),
        "--object-store-memory",
        str(256 * 1024**2),
        "--disable-usage-stats",
        "--node-ip-address",
        "127.0.0.1",
        *ports,
    ]
    if temp_dir is not None:
        return [
            ray,
            "start",
            "--head",
            "--port",
            str(head_port),
            "--include-dashboard",
            "false",
            "--ray-client-server-port",
            str(free_port()),
            "--temp-dir",
            str(temp_dir),
            *common,
        ]
    return [ray, "start", "--address", f"127.0.0.1:{head_port}", *common]


def start_node(head_port: int, cpus: int, work: Path, env: dict[str, str], name: str, head: bool) -> subprocess.Popen:
    """One `ray start --block` in a session of its own (its process group is the node's), logging
    to `work/ray-<name>.log`."""
    command = ray_start_command(head_port, cpus, work / "ray" if head else None)
    say(f"{name}: {' '.join(command[1:4])} ... --num-cpus {cpus}")
    log = (work / f"ray-{name}.log").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_cluster(group: CpuNodeGroup, work: Path, env: dict[str, str]) -> tuple[int, list[subprocess.Popen]]:
    import ray

    head_port, nodes = free_port(), []
    for index in range(group.max_size):
        nodes.append(start_node(head_port, group.cpus_per_node, work, env, f"node-{index}", head=index == 0))
        if index == 0:
            _wait(
                lambda: "Ray runtime started" in (work / "ray-node-0.log").read_text(), 120, "the head node", nodes[0]
            )
    ray.init(address=f"127.0.0.1:{head_port}", logging_level="warning", log_to_driver=False)
    for noisy in ("ray", "ray.serve", "httpx"):  # Ray's logging setup shows every request otherwise
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # The Ray driver swallowed a SIGINT in one run; ours stop the demo, and tear down, on both.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    _wait(lambda: alive_nodes() == group.max_size, 120, "every node to join", nodes[-1])
    say(f"Ray cluster up: {group.max_size} nodes x {group.cpus_per_node} logical CPUs")
    return head_port, nodes


def alive_nodes() -> int:
    import ray

    return sum(n["Alive"] for n in ray.nodes())


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _wait(condition: Callable[[], bool], timeout_s: float, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"waiting for {what}: `ray start` exited with {process.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.5)


def deploy(spec: StackSpec, serve_port: int) -> tuple[str, str]:
    """The stack's serve config on the cluster; proxy on the head only (every node's proxy
    would bind the same loopback port) and engines unpinned (see ENGINE_ENV_ON_SHARED_HOST).
    Returns (application, model deployment) names."""
    from ray import serve

    config = local_serve_config(spec, serve_port) | {"proxy_location": "HeadOnly"}
    for application in config["applications"]:
        for llm in application["args"].get("llm_configs", []):
            llm["runtime_env"]["env_vars"].update(ENGINE_ENV_ON_SHARED_HOST)
    app = app_name(spec.models[0])
    serve.start(proxy_location=config["proxy_location"], http_options=config["http_options"])
    # Declaratively, as make dev and KubeRay deploy: the autoscaling lives in the config's
    # `deployments:` overrides, which only a declarative deploy applies.
    local_serve.deploy(config)
    local_serve.wait_running(app, timeout_s=DEPLOY_TIMEOUT_S, on_change=say)  # make dev's progress lines
    status = serve.status().applications[app]
    model = next(name for name in status.deployments if name.startswith("LLMServer:"))
    return app, model


def replica_states(app: str, deployment: str) -> dict[str, int]:
    from ray import serve

    status = serve.status().applications.get(app)
    states = status.deployments[deployment].replica_states if status and deployment in status.deployments else {}
    return {getattr(state, "value", str(state)): n for state, n in states.items() if n}


def replicas_by_node(nodes: list[subprocess.Popen], deployment: str) -> list[tuple[int, psutil.Process]]:
    """(node index, process) of each replica actor of `deployment` in OUR cluster: found among
    the descendants of our own `ray start` processes by Ray's process title."""
    return [(index, process) for index, node in enumerate(nodes) for process in replica_processes(node.pid, deployment)]


def pick_victim(replicas: list[tuple[int, float, int]], kill: Kill) -> tuple[int, int] | None:
    """What to kill among the replicas, each (node index, CPU seconds its process tree just used,
    pid): (node index, pid), or None when there is nothing fit. `replica`: the busiest (serving the
    most streams); `node`: the busiest on a worker node (index > 0): the head holds the cluster
    itself (GCS, Serve's controller, HAProxy), which a stack runs on a node of its own, not a
    reclaimable one."""
    fit = [r for r in replicas if kill == "replica" or r[0] > 0]
    if not fit:
        return None
    node, _, pid = max(fit, key=lambda r: r[1])
    return node, pid


def busy_cpu_s(replicas: list[psutil.Process], window_s: float) -> list[float]:
    """CPU seconds each replica's process tree (its vLLM engine) uses over `window_s`: the one
    serving streams burns it, an idle one hardly any."""
    before = [tree_cpu_s(p) for p in replicas]
    time.sleep(window_s)
    return [tree_cpu_s(p) - b for p, b in zip(replicas, before, strict=True)]


def kill_node(node: subprocess.Popen) -> list[int]:
    """SIGKILL every process of a Ray node at once, as a machine that vanishes: its `ray start`,
    that session's process group (raylet, agents) and every descendant, Ray workers in sessions
    of their own included. Returns the pids signalled."""
    members = [psutil.Process(node.pid)]
    with suppress(psutil.NoSuchProcess):
        members += members[0].children(recursive=True)
    with suppress(ProcessLookupError):
        os.killpg(node.pid, signal.SIGKILL)
    for member in members:
        with suppress(psutil.NoSuchProcess):
            member.kill()
    return sorted(m.pid for m in members)


def demo_gateway_settings(spec: StackSpec) -> dict[str, Any]:
    """The gateway's settings as the stack renders them for its Deployment (`gateway.stream_resume`,
    body extensions, models, routes, queues), every port bound to loopback on this machine."""
    rendered = json.loads(gateway_settings(spec, path=SERVING_PATH))
    return rendered | {"host": "127.0.0.1", "metrics_host": "127.0.0.1"}


def start_gateway(spec: StackSpec, serve_port: int, work: Path, stack: ExitStack) -> tuple[GatewayProcess, str]:
    """A private redis-server and the gateway on it in front of Serve, both stopped when `stack`
    closes; returns the gateway and a key without limits for the load."""
    settings = demo_gateway_settings(spec)
    if not settings["stream_resume"]["enabled"]:
        raise RuntimeError("the stack's gateway.stream_resume.enabled is not true: nothing would resume a stream")
    redis = start_redis()
    stack.callback(redis.stop)
    gateway = stack.enter_context(
        running_gateway(
            work / "gateway.log", upstream=f"http://127.0.0.1:{serve_port}", redis_url=redis.url, settings=settings
        )
    )
    say(f"gateway {gateway.url} (pid {gateway.process.pid}) in front of Serve, stream resume on, Redis {redis.url}")
    return gateway, create_key_sync(redis.url, "autoscale-demo", "autoscale-demo", limits=GENEROUS)


def streams_in_flight(due_s: list[float], elapsed_s: float, ended: int) -> int:
    """Open loop: the requests due by `elapsed_s` on the schedule (`due_s`, sorted offsets from the
    level's start) less the `ended` ones: what the client has open."""
    return bisect.bisect_right(due_s, elapsed_s) - ended


class LoadThread(threading.Thread):
    """Load from `ops.llmctl.bench.loadgen` until `stop` is set; results kept in order of completion.
    `in_flight()`: the requests open now (the open loop's schedule is known in advance)."""

    def __init__(self, spec: LoadSpec, mode: Literal["concurrency", "rate"], level: float) -> None:
        super().__init__(daemon=True)
        self.spec, self.mode, self.level = spec, mode, level
        self.stop, self.results = threading.Event(), list[RequestResult]()
        # An hour of the schedule: the demo stops its load long before.
        self.due_s = (
            [a.at_s for a in itertools.islice(schedule(spec, level), int(level * 3600))] if mode == "rate" else []
        )
        self.started = time.monotonic()

    def in_flight(self) -> int:
        if self.mode == "concurrency":
            return int(self.level)
        return streams_in_flight(self.due_s, time.monotonic() - self.started, len(self.results))

    def run(self) -> None:
        # Serve's start re-applies Ray's logging setup, which shows every request at INFO.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.started = time.monotonic()
        asyncio.run(
            run_level(
                self.spec,
                self.mode,
                self.level,
                stop=self.stop.is_set,
                on_result=self.results.append,
                start_at=self.started,
            )
        )


def wait_for_streams(loader: LoadThread, streams: int, timeout_s: float) -> int:
    """Wait until the client has `streams` requests open, at most `timeout_s`; returns how many are."""
    deadline = time.monotonic() + timeout_s
    while (now_open := loader.in_flight()) < streams and time.monotonic() < deadline:
        time.sleep(0.005)
    if now_open < streams:
        say(f"{now_open} streams open, not {streams}, {timeout_s:.0f} s on: killing anyway")
    return now_open


def run_demo(
    stack: str,
    mode: Literal["concurrency", "rate"],
    level: float,
    output_tokens: str,
    hold_s: float,
    work: Path,
    record: dict[str, Any],
    *,
    through_gateway: bool = False,
    kill: Kill = "replica",
    kill_in_flight: int = 0,
) -> None:
    """Runs the demo, filling `record` as it goes (so a failed stage keeps what was measured)."""
    spec = load_stack(stack)
    model = spec.models[0]
    group = spec.node_group(model.node_group)
    assert isinstance(group, CpuNodeGroup), "the demo runs CPU node groups on this machine"
    # A private token: our cluster neither trusts nor is reachable with another cluster's.
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    # make dev's serving path; Ray reads it at import in every process, so `ray start` gets it too.
    os.environ.update(local_serving_env(spec, SERVING_PATH, haproxy_dir()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_ROOT), os.environ.get("PYTHONPATH")]))}
    record.update(
        engine_env_override=ENGINE_ENV_ON_SHARED_HOST,
        stack=stack,
        model=model.id,
        autoscaling=model.autoscaling.model_dump(),
        nodes=group.max_size,
        cpus_per_node=group.cpus_per_node,
        load_mode=mode,
        load_level=level,
        hold_s=hold_s,
        through_gateway=through_gateway,
        kill_what=kill,
        kill_in_flight=kill_in_flight,
        loadavg_at_start=os.getloadavg(),
    )
    nodes: list[subprocess.Popen] = []
    samples: list[Sample] = []
    sampling = threading.Event()
    loader: LoadThread | None = None
    load_start = time.monotonic()
    services = ExitStack()  # the gateway and its Redis
    try:
        head_port, nodes = start_cluster(group, work, env)
        serve_port = free_port()
        t0 = time.monotonic()
        app, deployment = deploy(spec, serve_port)
        record["deploy_s"] = round(time.monotonic() - t0, 1)
        gateway: GatewayProcess | None = None
        if through_gateway:
            gateway, key = start_gateway(spec, serve_port, work, services)
            base_url = f"{gateway.url}/v1"
        else:
            key, base_url = "EMPTY", f"http://127.0.0.1:{serve_port}{route_prefix(model).rstrip('/')}/v1"
        load = LoadSpec(
            base_url=base_url,
            api_key=key,
            model=model.model_name,
            prompt_tokens=LengthDistribution.parse("fixed:64"),
            output_tokens=LengthDistribution.parse(output_tokens),
            timeout_s=120,
        )
        record["load"] = load.model_dump(mode="json", exclude={"api_key"})

        def sample_every_second() -> None:
            while not sampling.is_set():
                samples.append(Sample(t=time.monotonic(), states=replica_states(app, deployment)))
                sampling.wait(1.0)

        threading.Thread(target=sample_every_second, daemon=True).start()
        running = lambda: samples[-1].running if samples else 0  # noqa: E731
        _wait(lambda: running() == 1, 60, "one running replica before load")

        counters_before = resume_counters(gateway.metrics_url) if gateway else {}
        loader = LoadThread(load, mode, level)
        load_start = time.monotonic()
        loader.start()
        say(
            f"load: {level:g} {'requests/s (Poisson)' if mode == 'rate' else 'concurrent streams'}, "
            f"64 in / {output_tokens} out tokens, at {load.base_url}"
        )
        _wait(lambda: running() >= 2, 600, "the second replica")
        say(f"scaled up: 2 replicas running {time.monotonic() - load_start:.0f} s after load started")
        time.sleep(hold_s)

        victims = replicas_by_node(nodes, deployment)
        # A kill while no stream is open shows nothing (run 5: 0 in flight at 3/s): wait for some.
        open_at_kill = wait_for_streams(loader, kill_in_flight, timeout_s=120)
        # Serve's router need not spread them evenly (run 7 killed an idle replica): the busiest goes.
        busy = busy_cpu_s([p for _, p in victims], window_s=0.5)
        choice = pick_victim([(i, cpu, p.pid) for (i, p), cpu in zip(victims, busy, strict=True)], kill)
        if choice is None:
            raise RuntimeError(f"nothing to kill: replicas on nodes {sorted(i + 1 for i, _ in victims)}, --kill {kill}")
        node_index, victim_pid = choice
        victim = psutil.Process(victim_pid)
        engines = [p.pid for p in victim.children(recursive=True)]
        record["kill"] = {
            "streams_open": open_at_kill,
            "replicas_cpu_s_in_half_a_second": [
                (i + 1, p.pid, round(c, 3)) for (i, p), c in zip(victims, busy, strict=True)
            ],
            "what": kill,
            "pid": victim.pid,
            "node": node_index + 1,
            "engine_pids": engines,
            "replicas_found": [(i + 1, p.pid) for i, p in victims],
            "node_pids": [n.pid for n in nodes],
        }
        kill_at = time.monotonic()
        if kill == "node":
            killed = kill_node(nodes[node_index])
            say(
                f"killed Ray node {node_index + 1} (ray start pid {nodes[node_index].pid}, {len(killed)} processes, "
                f"replica pid {victim.pid}) under load"
            )
            record["kill"]["node_processes_killed"] = killed
            # As the node autoscaler would bring a new machine: a worker node joins in its place.
            nodes.append(start_node(head_port, group.cpus_per_node, work, env, f"node-{len(nodes)}", head=False))
            record["kill"]["replacement_node_pid"] = nodes[-1].pid
        else:
            killed = [victim.pid, *engines]
            victim.send_signal(signal.SIGKILL)
            say(f"killed replica pid {victim.pid} on node {node_index + 1} (engine pids {engines}) under load")
        try:
            _wait(lambda: any(s.t > kill_at and s.running < 2 for s in samples), 120, "Serve to notice the kill")
        except TimeoutError:  # replaced between two samples: the findings say so (kill_detected_s None)
            say("no sample showed fewer than 2 running replicas after the kill")
        _wait(lambda: running() >= 2 and samples[-1].t > kill_at, 600, "Serve to replace the replica")
        say(f"recovered: 2 replicas running {time.monotonic() - kill_at:.0f} s after the kill")
        record["kill"]["left_alive"] = [pid for pid in killed if _alive(pid)]
        time.sleep(hold_s)

        loader.stop.set()
        load_stop = time.monotonic()
        loader.join(timeout=180)
        if gateway is not None:
            record["gateway_resumes"] = counter_deltas(counters_before, resume_counters(gateway.metrics_url))
        say("load stopped; waiting for the scale-down to 1 replica")
        _wait(lambda: samples[-1].t > load_stop and running() == 1 and samples[-1].total == 1, 600, "scale-down")
        time.sleep(2)
        sampling.set()

        results: list[RequestResult] = list(loader.results)
        record["events_s"] = {
            "load_start": 0.0,
            "kill": round(kill_at - load_start, 1),
            "load_stop": round(load_stop - load_start, 1),
        }
        record["findings"] = findings(samples, results, load_start, kill_at, load_stop).model_dump()
        record["load_summary"] = summarise(results, mode, level).model_dump()
        record["requests"] = [
            {"start": round(r.start - load_start, 3), "end": round(r.end - load_start, 3), "error": r.error}
            for r in results
        ]
    finally:
        sampling.set()
        if loader is not None:
            loader.stop.set()
        record["samples"] = [(round(s.t - load_start, 1), s.states) for s in samples]
        record["loadavg_at_end"] = os.getloadavg()
        services.close()
        _teardown(nodes)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _teardown(nodes: list[subprocess.Popen]) -> None:
    """Serve and the driver first, then our `ray start` processes by id (each stops its own
    raylet, GCS and workers on SIGTERM; leftovers of their sessions are killed)."""
    import ray

    say("stopping Serve and the Ray cluster we started ...")
    if ray.is_initialized():
        try:
            from ray import serve

            serve.shutdown()
        finally:
            ray.shutdown()
    for node in reversed(nodes):
        stop_tree(node, 60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.benchmarks.autoscale_demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--stack", default=DEFAULT_STACK, help="stack with one model, min 1 / max 2 replicas")
    parser.add_argument("--out", type=Path, default=Path("build/bench/autoscale.json"))
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=3.0, help="requests/s during the load (open loop; default 3)")
    load.add_argument("--concurrency", type=int, help="closed loop instead: this many requests in flight")
    parser.add_argument("--output-tokens", default="fixed:128", help="max_tokens per request (llmctl bench form)")
    parser.add_argument("--hold", type=float, default=20, help="seconds of load kept after each scale event")
    parser.add_argument(
        "--through-gateway",
        action="store_true",
        help="load through the gateway (the stack's settings, stream resume on) in front of Serve, not straight at it",
    )
    parser.add_argument(
        "--kill",
        choices=("replica", "node"),
        default="replica",
        help="SIGKILL the busiest replica's process (default), or every process of the worker node hosting the "
        "busiest replica on a worker node",
    )
    parser.add_argument(
        "--kill-in-flight",
        type=int,
        default=4,
        help="kill once the client has this many streams open (at most 120 s after the hold; default 4: with "
        "two replicas sharing them, one has none 1 time in 16)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    import tempfile

    # A short path: Ray's socket paths under it must stay within the 107-byte Unix limit.
    mode: Literal["concurrency", "rate"] = "concurrency" if args.concurrency else "rate"
    level = args.concurrency if args.concurrency else args.rate
    record: dict[str, Any] = {"command": "python -m ops.benchmarks.autoscale_demo " + " ".join(argv or sys.argv[1:])}
    try:
        with tempfile.TemporaryDirectory(prefix="llmas-") as folder:
            try:
                run_demo(
                    args.stack,
                    mode,
                    level,
                    args.output_tokens,
                    args.hold,
                    Path(folder),
                    record,
                    through_gateway=args.through_gateway,
                    kill=args.kill,
                    kill_in_flight=args.kill_in_flight,
                )
            finally:  # the gateway's log outlives the run's temp dir, beside the record
                if (Path(folder) / "gateway.log").exists():
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(Path(folder) / "gateway.log", args.out.with_suffix(".gateway.log"))
    except (RuntimeError, TimeoutError, KeyboardInterrupt) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
        say(f"error: {record['error']}")
    finally:  # whatever was measured is written, also when a stage failed
        record["wall_time_s"] = round(time.monotonic() - started, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=2))
    if "findings" not in record:
        return 1
    f = record["findings"]
    say(
        f"scale-up {f['scaled_up_s']} s, kill detected {f['kill_detected_s']} s, recovered {f['recovered_s']} s "
        f"({f['failed_after_kill']} requests failed: {f['failed_after_kill_by_type']}), "
        f"scale-down {f['scaled_down_s']} s after load; written to {args.out}"
    )
    say(
        f"in flight at the kill: {f['in_flight_at_kill']}, cut {f['in_flight_at_kill_failed']}; "
        f"their pause around the kill {f['in_flight_gap_s']}"
    )
    if "gateway_resumes" in record:
        g = record["gateway_resumes"]
        p50, p99 = (round(g[name], 3) if name in g else None for name in ("p50_gap_s", "p99_gap_s"))
        say(
            f"gateway: {g['llmstack_gateway_stream_resumes_total']:g} streams resumed, "
            f"{g['llmstack_gateway_stream_resume_failures_total']:g} resumes failed, "
            f"{g['llmstack_gateway_answer_retries_total']:g} answers retried; resume gap p50 {p50} / p99 {p99} s "
            f"(its histogram; every counter in {args.out})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
