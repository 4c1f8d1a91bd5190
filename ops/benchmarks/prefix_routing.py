"""Prefix-aware routing against Serve's default, on a multi-turn load, in one run.

    python -m ops.benchmarks.prefix_routing [--out build/bench/prefix_routing.json] [--quick]

Starts `make dev`'s stack for `tests/stacks/Pulumi.prefix.yaml`: the tiny model twice, two
replicas each, `tiny-pow2` routed by Serve's power-of-two-choices router and `tiny-prefix` by
Ray Serve LLM's PrefixCacheAffinityRouter (`routing: prefix`). Then drives each straight at
its Serve URL with `llmctl bench --workload multiturn` (conversations that share a system
prompt and resend their whole history every turn), in rounds that alternate which model goes
first and use a new seed each round (so no round finds the previous one's conversations
cached). Reported per model: the prefix cache hit rate (cached / prompt tokens, as vLLM counts
them per request in `usage.prompt_tokens_details.cached_tokens`), TTFT and throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ops.benchmarks.serving import start_dev_stack
from ops.harness.processes import free_port, stop_tree

STACK = "tests/stacks/Pulumi.prefix.yaml"
MODELS = ("tiny-pow2", "tiny-prefix")
# 8 conversations in flight, 4 turns each; prompts of a 160-word shared system prompt plus 48
# words per user turn and 24-token answers: turn 4 is about 650 tokens, 5 CPU KV blocks of 128.
LOAD = [
    "--workload",
    "multiturn",
    "--api",
    "chat",
    "--concurrency",
    "8",
    "--turns",
    "4",
    "--system-prompt-tokens",
    "160",
    "--prompt-tokens",
    "fixed:48",
    "--output-tokens",
    "fixed:24",
]


def say(message: str) -> None:
    print(f"[bench-prefix] {message}", file=sys.stderr, flush=True)


def bench_args(url: str, model: str, requests: int, seed: int, out: Path) -> list[str]:
    return [
        "--url",
        url,
        "--model",
        model,
        *LOAD,
        "--requests",
        str(requests),
        "--seed",
        str(seed),
        "--no-plot",
        "--out",
        str(out),
    ]


def figures(report: dict[str, Any]) -> dict[str, Any]:
    """What we compare, from an `llmctl bench --out` report of one level."""
    level = report["levels"][0]
    return {
        "requests": level["requests"],
        "ok": level["ok"],
        "prompt_tokens": level["prompt_tokens"],
        "cached_prompt_tokens": level["cached_prompt_tokens"],
        "hit_rate": level["prefix_cache_hit_rate"],
        "ttft_p50_ms": level["ttft_ms"]["p50"],
        "ttft_p90_ms": level["ttft_ms"]["p90"],
        "output_throughput": level["output_throughput"],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per model over all rounds: hit rate (token-weighted) and the mean of the rounds' TTFT p50."""
    out: dict[str, dict[str, float | None]] = {}
    for model in MODELS:
        mine = [r for r in runs if r["model"] == model and r.get("ok")]
        prompt = sum(r["prompt_tokens"] for r in mine)
        cached = sum(r["cached_prompt_tokens"] or 0 for r in mine)
        ttfts = [r["ttft_p50_ms"] for r in mine if r["ttft_p50_ms"] is not None]
        out[model] = {
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "ttft_p50_ms": round(sum(ttfts) / len(ttfts), 1) if ttfts else None,
            "rounds": len(mine),
        }
    return out


def markdown_report(runs: list[dict[str, Any]]) -> str:
    lines = [
        "| round | model (routing) | requests ok | prompt tokens | cached | hit rate | TTFT p50 ms | "
        "TTFT p90 ms | output tok/s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        hit = "n/a" if r.get("hit_rate") is None else f"{r['hit_rate']:.1%}"
        lines.append(
            f"| {r['round']} | {r['model']} | {r.get('ok', 0)}/{r.get('requests', '?')} | "
            f"{r.get('prompt_tokens', 0):,} | {r.get('cached_prompt_tokens') or 0:,} | {hit} | "
            f"{r.get('ttft_p50_ms') or 0:,.1f} | {r.get('ttft_p90_ms') or 0:,.1f} | "
            f"{r.get('output_throughput') or 0:,.0f} |"
        )
    lines.append("")
    for model, s in summary(runs).items():
        hit = "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}"
        lines.append(f"- {model}: hit rate {hit}, TTFT p50 (mean of rounds) {s['ttft_p50_ms']} ms")
    return "\n".join(lines)


def run(rounds: int, requests: int, work: Path, runs: list[dict[str, Any]]) -> None:
    dev, ready = start_dev_stack(free_port(), str(work / "dev-state"), stack=STACK)
    try:
        for round_ in range(rounds):
            order = MODELS if round_ % 2 == 0 else tuple(reversed(MODELS))
            for model in order:
                out = work / f"{model}-{round_}.json"
                say(f"round {round_ + 1}/{rounds}: {model}, {requests} turns ...")
                command = [
                    sys.executable,
                    "-m",
                    "ops.llmctl.main",
                    "bench",
                    *bench_args(ready["model_urls"][model], model, requests, round_, out),
                ]
                done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
                record: dict[str, Any] = {"round": round_ + 1, "model": model, "loadavg": os.getloadavg()}
                if done.returncode != 0 or not out.exists():
                    say(f"  llmctl bench failed (exit {done.returncode}): {(done.stdout + done.stderr)[-1500:]}")
                    runs.append(record)
                    continue
                record |= figures(json.loads(out.read_text()))
                runs.append(record)
                say(f"  hit rate {record['hit_rate']}, TTFT p50 {record['ttft_p50_ms']} ms")
    finally:
        say("stopping ops.devstack ...")
        stop_tree(dev, 180, say)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.benchmarks.prefix_routing", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("build/bench/prefix_routing.json"))
    parser.add_argument("--quick", action="store_true", help="one round of 16 turns per model (smoke run)")
    args = parser.parse_args(argv)
    rounds, requests = (1, 16) if args.quick else (2, 96)
    started, runs, loadavg = time.monotonic(), list[dict[str, Any]](), os.getloadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="llmstack-bench-prefix-") as folder:
            run(rounds, requests, Path(folder), runs)
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "command": "python -m ops.benchmarks.prefix_routing" + (" --quick" if args.quick else ""),
                    "stack": STACK,
                    "load": LOAD,
                    "requests_per_run": requests,
                    "loadavg_at_start": loadavg,
                    "loadavg_at_end": os.getloadavg(),
                    "wall_time_s": round(time.monotonic() - started, 1),
                    "runs": runs,
                    "summary": summary(runs),
                },
                indent=2,
            )
        )
        print(markdown_report(runs), flush=True)
        print(f"\nload average at start {loadavg[0]:.2f}, at end {os.getloadavg()[0]:.2f}", flush=True)
    return 0 if len(runs) == rounds * len(MODELS) and all(r.get("ok") == r.get("requests") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
