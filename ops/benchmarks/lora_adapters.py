"""LoRA adapters: cold-load time, and the throughput cost of mixing adapters (issue 28, "Evidence").

    # a running model, as `llmctl bench --adapters` measures it (the same code: ops.llmctl.bench.adapters)
    python -m ops.benchmarks.lora_adapters --url <model_urls[tiny-chat] of python -m ops.devstack --ready-json> \\
        --model tiny-chat --adapters sql,pirate [--requests 64 --concurrency 8 --max-tokens 32]
    # twenty adapters over two replicas that hold fewer: a stack of its own
    python -m ops.benchmarks.lora_adapters --many 20 [--replicas 2 --max-loras 4 --per-replica 8] \\
        [--requests 64 --concurrency 8 --max-tokens 32] [--out build/bench/lora_adapters.json]
    python -m ops.benchmarks.lora_adapters --many 20 --requests 24 --concurrency 4 --max-tokens 8   # a short check

`--many N` writes a stack file from Pulumi.local.yaml (`stack_text`): tiny-chat alone, at
`--replicas` replicas (min = max), serving N numbered tiny adapters made from fixed seeds
(`tiny-chat:a01` ... from `ops.devstack.tiny_adapter`'s `tiny-llama-a01` ...), vLLM `max_loras`
`--max-loras` and Ray Serve LLM's `max_num_adapters_per_replica` `--per-replica`, both below N, so
adapters must swap in and out. It starts that stack with `python -m ops.devstack` (make dev's
runner, its own state folder and ports), measures at tiny-chat's own Serve application (the
gateway left out): every adapter's cold load (p50/p95 over them), then the same requests to the
base alone, round-robin over the N adapters, and over both, counting every failed request; then
`llmctl status` says which adapters each replica holds at the end, and the stack is stopped and
checked for processes left behind.

Evidence, not a test: absolute figures are this machine's; the ratios within one run are the
result, and only on a quiet machine (load average under ~2).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from infra.spec.stack_file import PROJECT_ROOT
from ops.devstack.tiny_adapter import numbered_adapter
from ops.llmctl.bench.adapters import AdapterBenchReport, adapter_tables, bench_adapters
from ops.llmctl.bench.loadgen import LoadSpec, make_client, one_request
from ops.llmctl.bench.stats import LengthDistribution

MODEL = "tiny-chat"
PROMPT_WORDS = 32


def stack_text(local_text: str, *, adapters: int, replicas: int, max_loras: int, per_replica: int) -> str:
    """Pulumi.local.yaml with tiny-chat alone at `replicas` replicas, serving `adapters` numbered
    tiny adapters (ids a01, a02, ...), `max_loras` vLLM slots and `per_replica` adapters kept per
    replica. Two replicas take four of the node's logical CPUs and the OpenAI ingress one: the
    six Pulumi.local.yaml gives fit them."""
    document = yaml.safe_load(local_text)
    config = document["config"]
    served = next(m for m in config["llmstack:models"] if m["id"] == MODEL)
    served["autoscaling"] = {**served.get("autoscaling", {}), "min_replicas": replicas, "max_replicas": replicas}
    served["lora"] = {
        **{k: v for k, v in served["lora"].items() if k != "adapters"},
        "max_loras": max_loras,
        "max_adapters_per_replica": per_replica,
        "adapters": [
            {
                "id": f"a{i:02d}",
                "source": f".cache/llmstack/adapters/{numbered_adapter(i)}",
                "base_model": "tiny-llama",
            }
            for i in range(1, adapters + 1)
        ],
    }
    config["llmstack:models"] = [served]
    return yaml.safe_dump(document, sort_keys=False)


def _spec(url: str, model: str, args: argparse.Namespace) -> LoadSpec:
    return LoadSpec(
        base_url=url,
        api_key=args.api_key,
        model=model,
        prompt_tokens=LengthDistribution.parse(f"fixed:{PROMPT_WORDS}"),
        output_tokens=LengthDistribution.parse(f"fixed:{args.max_tokens}"),
        timeout_s=args.timeout,
    )


async def measure(spec: LoadSpec, adapters: list[str], args: argparse.Namespace) -> AdapterBenchReport:
    async with make_client(spec) as client:  # the base warm before anything is timed
        warm = await one_request(client, spec, "hello", 1)
    if warm.error is not None:
        raise RuntimeError(f"the base model does not answer at {spec.base_url}: {warm.error}: {warm.error_message}")
    return await bench_adapters(
        spec,
        adapters,
        concurrency=args.concurrency,
        requests=args.requests,
        command=" ".join(["python -m ops.benchmarks.lora_adapters", *sys.argv[1:]]),
        on_phase=lambda phase: print(f"[lora_adapters] {phase}", file=sys.stderr, flush=True),
    )


def run_many(args: argparse.Namespace) -> dict[str, Any]:
    """`--many`: the stack of its own, measured, then stopped."""
    from ops.benchmarks.fair_capacity import Stack

    folder = Path(tempfile.mkdtemp(prefix="llmstack-lora-stack-"))
    stack_file = folder / "Pulumi.loramany.yaml"
    stack_file.write_text(
        stack_text(
            (PROJECT_ROOT / "Pulumi.local.yaml").read_text(),
            adapters=args.many,
            replicas=args.replicas,
            max_loras=args.max_loras,
            per_replica=args.per_replica,
        )
    )
    load_average = os.getloadavg()[0]
    stack = Stack(stack_file)
    try:
        adapters = [f"a{i:02d}" for i in range(1, args.many + 1)]
        report = asyncio.run(measure(_spec(stack.ready["model_urls"][MODEL], MODEL, args), adapters, args))
        loaded = _loaded_adapters(stack_file, stack.state_dir)
    finally:
        left = stack.stop()
    return {
        "report": json.loads(report.model_dump_json()),
        "stack": {
            "replicas": args.replicas,
            "adapters": args.many,
            "max_loras": args.max_loras,
            "max_adapters_per_replica": args.per_replica,
        },
        "adapters_loaded_at_end": loaded,
        "load_average_at_start": round(load_average, 2),
        "load_average_at_end": round(os.getloadavg()[0], 2),
        "processes_left": left,
        "devstack_log_tail": stack.stderr[-60:],
    }


def _loaded_adapters(stack_file: Path, state_dir: str) -> Any:
    """`llmctl status --json`'s adapter rows: at most --per-replica per replica after N were used."""
    result = subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "status", "--stack", str(stack_file), "--json"],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env={**os.environ, "LLMSTACK_STATE_DIR": state_dir},
        timeout=120,
    )
    try:
        status = json.loads(result.stdout)
    except ValueError:
        return {"error": (result.stderr or result.stdout)[-500:]}
    return {"rows": status.get("adapters"), "note": status.get("adapters_note")}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", help="OpenAI base URL of the model (its Serve app, or the gateway)")
    parser.add_argument("--model", default=MODEL, help="the base model's served name (with --url)")
    parser.add_argument("--adapters", help="adapter ids, comma-separated (with --url)")
    parser.add_argument("--many", type=int, help="instead of --url: a stack of its own serving this many adapters")
    parser.add_argument("--replicas", type=int, default=2, help="--many: tiny-chat's replicas")
    parser.add_argument("--max-loras", type=int, default=4, help="--many: vLLM max_loras")
    parser.add_argument("--per-replica", type=int, default=8, help="--many: max_adapters_per_replica")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--requests", type=int, default=64, help="requests per mix")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--out", default="build/bench/lora_adapters.json")
    args = parser.parse_args()
    if args.many is not None:
        if args.url or args.adapters:
            parser.error("--many runs a stack of its own: not with --url or --adapters")
        if not args.max_loras < args.many or not args.per_replica < args.many:
            parser.error("--many is about swapping: --max-loras and --per-replica must be below it")
        result = run_many(args)
        report = AdapterBenchReport.model_validate(result["report"])
    elif args.url and args.adapters:
        adapters = [a for a in args.adapters.split(",") if a]
        report = asyncio.run(measure(_spec(args.url, args.model, args), adapters, args))
        result = {"report": json.loads(report.model_dump_json()), "load_average_at_end": os.getloadavg()[0]}
    else:
        parser.error("give --url and --adapters (a running model), or --many N (a stack of its own)")
    from ops.llmctl.console import out

    for table in adapter_tables(report):
        out.print(table)
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}; {report.failed} requests failed; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
