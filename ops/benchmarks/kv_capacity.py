"""Compare the planner's KV-cache capacity with what vLLM itself allocates.

    python -m ops.benchmarks.kv_capacity --stack local [--json]

For each CPU model of the stack, start CPU vLLM offline with the engine settings the
renderer produces for it, read the KV cache size vLLM reports, and print it beside the
planner's figure. GPU models cannot be checked on a machine without GPUs; they are listed
as skipped. Each model runs in a fresh interpreter (`--one MODEL`) because vLLM reads its
environment (`VLLM_CPU_KVCACHE_SPACE`) once per process and starts its engine processes
with spawn, which does not nest inside a multiprocessing child.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ops.benchmarks.offline_engine import child_result, start_engine

RESULT_PREFIX = "KV_CACHE_TOKENS="


def _measure_one(stack: str, model_id: str) -> None:
    """Child process: start vLLM with the rendered engine settings, print its KV capacity."""
    llm = start_engine(stack, model_id)
    print(f"{RESULT_PREFIX}{llm.llm_engine.vllm_config.cache_config.kv_cache_size_tokens}", flush=True)


def measure(stack: str) -> list[dict[str, Any]]:
    from infra.plan.planner import plan_stack
    from infra.spec.schema import CpuNodeGroup
    from infra.spec.stack_file import load_stack

    spec = load_stack(stack)
    plans = {p.model_id: p for p in plan_stack(spec).models}
    results: list[dict[str, Any]] = []
    for model in spec.models:
        if not isinstance(spec.node_group(model.node_group), CpuNodeGroup):
            results.append({"model": model.id, "skipped": "GPU model: needs a GPU to measure"})
            continue
        print(f"starting CPU vLLM for {model.id} ...", file=sys.stderr, flush=True)
        measured = int(child_result("ops.benchmarks.kv_capacity", stack, model.id, RESULT_PREFIX))
        planned = plans[model.id].kv_tokens_per_replica
        results.append(
            {
                "model": model.id,
                "planner_tokens": planned,
                "vllm_tokens": measured,
                "ratio": round(planned / measured, 4),
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", default="local")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--one", metavar="MODEL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        _measure_one(args.stack, args.one)
        return
    results = measure(args.stack)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for r in results:
        if "skipped" in r:
            print(f"{r['model']}: skipped ({r['skipped']})")
        else:
            print(
                f"{r['model']}: planner {r['planner_tokens']:,} tokens, vLLM {r['vllm_tokens']:,} tokens, "
                f"ratio {r['ratio']:.4f}"
            )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
