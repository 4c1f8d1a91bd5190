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
Within the Serve ingress, the Python process that handles each request (the LLMRouter on the
direct path, the OpenAI ingress on the others) is also reported on its own as `ingress router`:
it is what `infra/serving_estimates.yaml` sizes.
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
_RAY_MARKS = ("raylet", "gcs_server", "ray::ServeController", "ray::IDLE", "ray::TelemetryAgent", "dashboard",
              "log_monitor", "runtime_env", "ray/_private", "ray::")


def layer_of(name: str, cmdline: Iterable[str]) -> str:
    """The layer a process belongs to, from its name and command line. Pure."""
    text = " ".join([name, *cmdline])
    if "EngineCore" in text or "VLLM::Worker" in text or "VllmWorker" in text:
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


def cpu_ms_per_token(cpu_s_by_layer: Mapping[str, float], output_tokens: int) -> dict[str, float]:
    """CPU seconds per layer over a run -> CPU-ms per output token, with the `serving layers`
    sum and the `total`. Empty when no token was generated. Pure."""
    if output_tokens <= 0:
        return {}
    per_token = {layer: round(1000 * cpu_s_by_layer.get(layer, 0.0) / output_tokens, 4) for layer in (*LAYERS, ROUTER)}
    per_token["serving layers"] = round(sum(per_token[layer] for layer in SERVING_LAYERS), 4)
    per_token["total"] = round(sum(per_token[layer] for layer in LAYERS), 4)
    return per_token


class CpuSampler:
    """CPU time of every process under `roots` (and the roots themselves), by layer, between
    `start()` and `stop()`. A process that starts in between counts from zero; one that ends
    in between loses what it used since `start()` (short-lived helpers only, in practice)."""

    def __init__(self, roots: Iterable[int], *, include_self: bool = False) -> None:
        self._roots = list(roots)
        self._include_self = include_self
        self._before: dict[tuple[int, float], float] = {}

    def _snapshot(self) -> dict[tuple[int, float], tuple[str, bool, float]]:
        import psutil

        seen: dict[tuple[int, float], tuple[str, bool, float]] = {}
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
                        router = any(mark in " ".join(cmdline) for mark in _ROUTER_MARKS)
                        seen[key] = (layer_of(process.name(), cmdline), router, times.user + times.system)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
        return seen

    def start(self) -> None:
        self._before = {key: cpu for key, (_, _, cpu) in self._snapshot().items()}

    def stop(self) -> dict[str, float]:
        """CPU seconds per layer (and of the ingress router, also counted in its layer) since `start()`."""
        used: dict[str, float] = defaultdict(float)
        for key, (layer, router, cpu) in self._snapshot().items():
            delta = max(0.0, cpu - self._before.get(key, 0.0))
            used[layer] += delta
            if router:
                used[ROUTER] += delta
        return dict(used)
