"""One-client added latency of this checkout's gateway against a baseline checkout's, A/B in
one run, interleaved finely enough that the machine's load drift hits both alike.

    python -m ops.benchmarks.gateway_ab --baseline-src DIR [--candidate-src DIR] [--rounds 40]
        [--batch 100] [--candidate-tracing RATIO] [--out build/bench/gateway_ab.json]

One stub upstream (`ops.harness.stub_upstream`) serves both gateways: the candidate (this
checkout, or `--candidate-src`) and the baseline. Each runs from its own checkout
(`python -m serving.gateway` with that checkout as the working directory, so its own modules
are imported) with its own redis-server, and its key is made by its own code (key records and
limiter state change between versions). One client sends one request at a time: per round,
`--batch` requests to each of the stub directly, the candidate and the baseline, interleaved
request by request in an order that flips every time. Per round, added p50 = a gateway's
median latency minus the direct path's, and the ratio of the candidate's added p50 to the
baseline's. Figures: the median of the per-round ratios,
its quartiles and extremes, the median added p50 of each side, CPU milliseconds per request of
each gateway process plus its redis-server (/proc), both commits and the load average.
Whole-benchmark runs alternated minutes apart measure the other tenants of a shared machine
more than the gateway; requests interleaved milliseconds apart see the same machine.

`--candidate-tracing RATIO` turns the candidate's tracing on at that sampling (spans to an
in-process OTLP receiver, ops.devstack.trace_collector): with `--baseline-src .` it measures what
observability.tracing costs against the same code with tracing off.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import psutil

from infra.spec.stack_file import PROJECT_ROOT
from ops.benchmarks.gateway import GENEROUS
from ops.devstack.local_redis import start_redis
from ops.devstack.trace_collector import trace_collector
from ops.harness.processes import background, free_port, wait_for_http
from ops.harness.stub_upstream import CHAT_BODY as BODY

# Run inside the checkout whose key format the gateway expects; prints the plaintext key.
_MAKE_KEY = (
    "import json, sys\n"
    "from serving.gateway.auth.keys import create_key_sync\n"
    "print(create_key_sync(sys.argv[1], 'bench', 'bench-ab', limits=json.loads(sys.argv[2])))\n"
)


def round_order(number: int, names: list[str]) -> list[str]:
    """Targets in the order turn `number` visits them: reversed every other turn, so no target
    always runs first or last."""
    return list(names) if number % 2 == 0 else list(reversed(names))


def median_ms(latencies_ms: list[float]) -> float:
    return statistics.median(latencies_ms)


def round_figures(medians: dict[str, float]) -> dict[str, float]:
    """One round's medians ({"direct", "candidate", "baseline"}, ms) -> added ms each and
    the candidate's added latency over the baseline's."""
    candidate = medians["candidate"] - medians["direct"]
    baseline = medians["baseline"] - medians["direct"]
    return {
        "candidate_added_ms": round(candidate, 4),
        "baseline_added_ms": round(baseline, 4),
        "ratio": round(candidate / baseline, 4) if baseline > 0 else float("nan"),
    }


def quantile(values: list[float], q: float) -> float:
    """Linear-interpolated quantile of `values` (q in [0, 1])."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Median of per-round ratios plus its spread; rounds whose baseline added nothing are left
    out of the ratio (they cannot say anything about it)."""
    ratios = [r["ratio"] for r in rounds if r["ratio"] == r["ratio"]]
    if not ratios:
        raise ValueError("no round had a positive baseline added latency")
    return {
        "rounds": len(rounds),
        "rounds_with_ratio": len(ratios),
        "ratio_median": round(statistics.median(ratios), 4),
        "ratio_q1": round(quantile(ratios, 0.25), 4),
        "ratio_q3": round(quantile(ratios, 0.75), 4),
        "ratio_min": round(min(ratios), 4),
        "ratio_max": round(max(ratios), 4),
        "candidate_added_ms_median": round(statistics.median(r["candidate_added_ms"] for r in rounds), 4),
        "baseline_added_ms_median": round(statistics.median(r["baseline_added_ms"] for r in rounds), 4),
        **{
            f"{side}_cpu_ms_per_request_median": round(statistics.median(r[f"{side}_cpu_ms"] for r in rounds), 4)
            for side in ("candidate", "baseline")
            if all(f"{side}_cpu_ms" in r for r in rounds)
        },
    }


def cpu_s(pids: list[int]) -> float:
    return sum(t.user + t.system for t in (psutil.Process(pid).cpu_times() for pid in pids))


def one_request(client: httpx.Client, url: str, key: str) -> float:
    started = time.perf_counter()
    client.post(f"{url}/v1/chat/completions", json=BODY, headers={"Authorization": f"Bearer {key}"}).raise_for_status()
    return (time.perf_counter() - started) * 1000


def one_round(
    clients: dict[str, httpx.Client], targets: dict[str, tuple[str, str, list[int]]], count: int
) -> tuple[dict[str, float], dict[str, float]]:
    """`count` requests to every target, one target after another request by request (the
    order flipping each time), so a change of the machine's load between two of them is a few
    milliseconds old at most. Returns each target's median latency and CPU ms per request."""
    names = list(targets)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    before = {name: cpu_s(targets[name][2]) for name in names}
    for i in range(count):
        for name in round_order(i, names):
            url, key, _ = targets[name]
            latencies[name].append(one_request(clients[name], url, key))
    cpu_ms = {name: (cpu_s(targets[name][2]) - before[name]) * 1000 / count for name in names}
    return {name: median_ms(values) for name, values in latencies.items()}, cpu_ms


def commit_of(source: Path) -> str | None:
    """The checkout's commit (with "+dirty" for uncommitted changes), or None outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=source, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=source,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{head}+dirty" if dirty else head


def start_gateway(
    stack: ExitStack, source: Path, stub: str, folder: Path, name: str, settings: dict | None = None
) -> tuple[str, str, list[int]]:
    """This checkout's gateway from `source`, its own Redis and a key its own code made.
    `settings`: more gateway settings than the model's name."""
    own_redis = start_redis()
    stack.callback(own_redis.stop)
    key = (
        subprocess.run(
            [sys.executable, "-c", _MAKE_KEY, own_redis.url, json.dumps(GENEROUS)],
            cwd=source,
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    port = free_port()
    # Older checkouts ignore the metrics port variable; newer ones serve /metrics on it.
    env = {
        "LLMSTACK_UPSTREAM_URL": stub,
        "LLMSTACK_REDIS_URL": own_redis.url,
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(free_port()),
        "LLMSTACK_GATEWAY_SETTINGS": json.dumps({"models": ["tiny"], **(settings or {})}),
    }
    process = stack.enter_context(
        background([sys.executable, "-m", "serving.gateway"], folder / f"gateway-{name}.log", env, cwd=source)
    )
    wait_for_http(f"http://127.0.0.1:{port}/healthz", process)
    return f"http://127.0.0.1:{port}", key, [process.pid, own_redis.process.pid]


def run(
    baseline: Path,
    *,
    rounds: int,
    batch_size: int,
    out: Path,
    candidate: Path = PROJECT_ROOT,
    candidate_tracing: float | None = None,
) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="llmstack-bench-ab-"))
    results: dict = {
        "candidate_src": str(candidate),
        "baseline_src": str(baseline),
        "batch": batch_size,
        "candidate_commit": commit_of(candidate),
        "baseline_commit": commit_of(baseline),
        "candidate_tracing": candidate_tracing,
        "load_average_start": os.getloadavg(),
        "rounds": [],
    }
    with ExitStack() as stack:
        stub_port = free_port()
        stub = f"http://127.0.0.1:{stub_port}"
        stub_process = stack.enter_context(
            background(
                [sys.executable, "-m", "ops.harness.stub_upstream", "--port", str(stub_port)], folder / "stub.log"
            )
        )
        wait_for_http(f"{stub}/v1/models", stub_process)
        candidate_settings = None
        if candidate_tracing is not None:
            collector = stack.enter_context(trace_collector(folder / "spans.jsonl"))
            candidate_settings = {"tracing": {"otlp_endpoint": collector, "sampling_ratio": candidate_tracing}}
        targets = {
            "direct": (stub, "unused", [stub_process.pid]),
            "candidate": start_gateway(stack, candidate, stub, folder, "candidate", candidate_settings),
            "baseline": start_gateway(stack, baseline, stub, folder, "baseline"),
        }
        clients = {name: stack.enter_context(httpx.Client(timeout=30)) for name in targets}
        one_round(clients, targets, batch_size)  # warm connections, caches, scripts
        for number in range(rounds):
            medians, cpu_ms = one_round(clients, targets, batch_size)
            row = {
                **round_figures(medians),
                **{f"{n}_p50_ms": round(m, 4) for n, m in medians.items()},
                # CPU of the gateway process and its redis-server (direct: the stub) per request
                **{f"{n}_cpu_ms": round(c, 4) for n, c in cpu_ms.items()},
                "load_1m": round(os.getloadavg()[0], 2),
            }
            results["rounds"].append(row)
            print(
                f"round {number + 1}: added p50 candidate {row['candidate_added_ms']:.3f} ms, "
                f"baseline {row['baseline_added_ms']:.3f} ms, ratio {row['ratio']:.3f}, CPU ms/request "
                f"{cpu_ms['candidate']:.3f} / {cpu_ms['baseline']:.3f}, load {row['load_1m']}",
                flush=True,
            )
    results["load_average_end"] = os.getloadavg()
    results["summary"] = summarize(results["rounds"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(
        json.dumps(
            {
                **results["summary"],
                "candidate_commit": results["candidate_commit"],
                "baseline_commit": results["baseline_commit"],
                "load_average_start": [round(v, 2) for v in results["load_average_start"]],
                "load_average_end": [round(v, 2) for v in results["load_average_end"]],
            }
        )
    )
    shutil.rmtree(folder, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description="One-client added latency: this checkout's gateway vs a baseline's.")
    parser.add_argument("--baseline-src", type=Path, required=True, help="a checkout of the baseline commit")
    parser.add_argument(
        "--candidate-src", type=Path, default=PROJECT_ROOT, help="the checkout to compare with it (default: this one)"
    )
    parser.add_argument("--rounds", type=int, default=40, help="rounds; each gives one ratio")
    parser.add_argument("--batch", type=int, default=100, help="requests per target per round")
    parser.add_argument("--out", type=Path, default=Path("build/bench/gateway_ab.json"))
    parser.add_argument(
        "--candidate-tracing",
        type=float,
        default=None,
        metavar="RATIO",
        help="the candidate traces this share of requests (observability.tracing.sampling_ratio); default off",
    )
    args = parser.parse_args()
    run(
        args.baseline_src.resolve(),
        rounds=args.rounds,
        batch_size=args.batch,
        out=args.out,
        candidate=args.candidate_src.resolve(),
        candidate_tracing=args.candidate_tracing,
    )


if __name__ == "__main__":
    main()
