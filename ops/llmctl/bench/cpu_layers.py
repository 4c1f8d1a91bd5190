"""Where the CPU goes: CPU-ms per output token for each layer of the serving path.

A layer is recognised from a process's name and command line (Ray names its actor processes
`ray::<class>`, vLLM its engine `VLLM::EngineCore`). Only processes under given root process
ids are counted (the benchmark, `make dev`, a bare vLLM server), so other work on a shared
machine stays out. `cpu_ms_per_token` is pure; `CpuSampler` is the thin psutil shell.

    client          the load generator (vLLM's benchmark client, llmctl bench)
    gateway         llmstack's gateway (`python -m serving.gateway`)
    serve ingress   HAProxy and Serve's proxy, the LLMRouter or OpenAI ingress replicas, the model list
    replica         the LLMServer replica (vLLM's OpenAI app runs in it); bare vLLM: its API server
    engine          vLLM's engine core and workers (the model itself)
    ray background  Serve's controller, raylet, GCS, idle workers and agents
Two parts are also reported on their own, beside the layers (not added to the sums): within the
Serve ingress, the Python process that handles each request (the LLMRouter on the direct path,
the OpenAI ingress on the others) as `ingress router`, which `infra/catalog/serving_estimates.yaml`
sizes; within the engine, the process that runs the model (vLLM's worker) as `engine worker`.

Besides CPU, the sampler reads how long each layer's threads stood runnable but unscheduled
(Linux's `/proc/<pid>/task/<tid>/schedstat`, second field): on a machine with fewer cores than
runnable threads, that run-queue wait is what one layer's CPU costs the others.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Mapping

LAYERS = ("client", "gateway", "serve ingress", "replica", "engine", "ray background", "other")
# The hops a token takes between the gateway and the engine (BENCHMARKS.md's "serving layers";
# Ray's background upkeep is reported beside them, not in them, as it was before this split).
SERVING_LAYERS = ("serve ingress", "replica")

_ROUTER_MARKS = (":LLMRouter", ":OpenAiIngress")
_INGRESS_MARKS = ("haproxy", "ray::ProxyActor", "ray::HAProxyManager", ":ModelList", *_ROUTER_MARKS)
ROUTER = "ingress router"  # a part of `serve ingress`, reported beside the layers
_WORKER_MARKS = ("VLLM::Worker", "VllmWorker")
WORKER = "engine worker"  # a part of `engine`: the process that runs the model, beside the engine core
PARTS = (ROUTER, WORKER)
_RAY_MARKS = (
    "raylet",
    "gcs_server",
    "ray::ServeController",
    "ray::IDLE",
    "ray::TelemetryAgent",
    "dashboard",
    "log_monitor",
    "runtime_env",
    "ray/_private",
    "ray::",
)


def layer_of(name: str, cmdline: Iterable[str]) -> str:
    """The layer a process belongs to, from its name and command line. Pure."""
    text = " ".join([name, *cmdline])
    if "EngineCore" in text or any(mark in text for mark in _WORKER_MARKS):
        return "engine"
    if "serving.gateway" in text:
        return "gateway"
    if any(mark in text for mark in _INGRESS_MARKS):
        return "serve ingress"
    if ":LLMServer" in text or "vllm.entrypoints.openai.api_server" in text:
        return "replica"
    if any(mark in text for mark in _RAY_MARKS):
        return "ray background"
    if "vllm.benchmarks" in text or "llmctl" in text or "ops.llmctl.main" in text:
        return "client"
    return "other"


def part_of(cmdline: Iterable[str]) -> str | None:
    """The part (`PARTS`) a process is, if any, from its command line (its title). Pure."""
    text = " ".join(cmdline)
    if any(mark in text for mark in _ROUTER_MARKS):
        return ROUTER
    if any(mark in text for mark in _WORKER_MARKS):
        return WORKER
    return None


def run_queue_wait_ns(schedstat: str) -> int:
    """Nanoseconds a thread waited runnable on a run queue, from its `schedstat` line
    (`<on cpu ns> <waiting ns> <timeslices>`). Pure."""
    return int(schedstat.split()[1])


def cpu_ms_per_token(cpu_s_by_layer: Mapping[str, float], output_tokens: int) -> dict[str, float]:
    """CPU seconds per layer over a run -> CPU-ms per output token, with the `serving layers`
    sum and the `total`. Empty when no token was generated. Pure."""
    if output_tokens <= 0:
        return {}
    per_token = {layer: round(1000 * cpu_s_by_layer.get(layer, 0.0) / output_tokens, 4) for layer in (*LAYERS, *PARTS)}
    per_token["serving layers"] = round(sum(per_token[layer] for layer in SERVING_LAYERS), 4)
    per_token["total"] = round(sum(per_token[layer] for layer in LAYERS), 4)
    return per_token


class CpuSampler:
    """CPU time of every process under `roots` (and the roots themselves), by layer, between
    `start()` and `stop()`. A process that starts in between counts from zero; one that ends
    in between loses what it used since `start()` (short-lived helpers only, in practice).
    `stop()` also leaves the run-queue wait of the same window in `waited_s` (empty where the
    kernel does not report it)."""

    def __init__(self, roots: Iterable[int], *, include_self: bool = False) -> None:
        self._roots = list(roots)
        self._include_self = include_self
        self._before: dict[tuple[int, float], tuple[float, float]] = {}
        self.waited_s: dict[str, float] = {}

    def _snapshot(self) -> dict[tuple[int, float], tuple[str, str | None, float, float]]:
        import psutil

        seen: dict[tuple[int, float], tuple[str, str | None, float, float]] = {}
        for root in self._roots:
            try:
                top = psutil.Process(root)
                processes = [top, *top.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
            for process in processes:
                if process.pid == os.getpid() and not self._include_self:
                    continue
                try:
                    with process.oneshot():
                        times = process.cpu_times()
                        key = (process.pid, process.create_time())  # a reused pid is another process
                        cmdline = process.cmdline()
                        seen[key] = (
                            layer_of(process.name(), cmdline),
                            part_of(cmdline),
                            times.user + times.system,
                            _waited_s(process.pid),
                        )
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
        return seen

    def start(self) -> None:
        self._before = {key: (cpu, waited) for key, (_, _, cpu, waited) in self._snapshot().items()}

    def stop(self) -> dict[str, float]:
        """CPU seconds per layer (and of each part, also counted in its layer) since `start()`."""
        used: dict[str, float] = defaultdict(float)
        waited: dict[str, float] = defaultdict(float)
        for key, (layer, part, cpu, wait) in self._snapshot().items():
            cpu_before, wait_before = self._before.get(key, (0.0, 0.0))
            for totals, delta in ((used, max(0.0, cpu - cpu_before)), (waited, max(0.0, wait - wait_before))):
                totals[layer] += delta
                if part:
                    totals[part] += delta
        self.waited_s = dict(waited) if any(waited.values()) else {}
        return dict(used)


def _waited_s(pid: int) -> float:
    """Run-queue wait of all of a process's threads, in seconds; 0 where /proc does not say."""
    total = 0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as file:
                total += run_queue_wait_ns(file.read())
        except (OSError, ValueError, IndexError):  # a thread that ended, or a kernel without schedstats
            continue
    return total / 1e9
