"""Compare the planner's LoRA slot memory with the buffers CPU vLLM itself allocates.

    python -m ops.benchmarks.lora_memory --stack local [--json]

For each CPU model of the stack with a `lora:` block, start CPU vLLM offline with the engine
settings the renderer produces for it (enable_lora, max_loras, max_lora_rank, ...), sum the
bytes of every LoRA slot buffer its LoRA manager made (`lora_a_stacked`, `lora_b_stacked` of each
wrapped module) and print it beside `infra.plan.lora_memory`'s figure. Each model runs in a fresh
interpreter (`--one MODEL`), as in `ops.benchmarks.kv_capacity`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ops.benchmarks.offline_engine import child_result, start_engine

RESULT_PREFIX = "LORA_SLOT_BYTES="


def slot_bytes_of_worker(worker: Any) -> dict[str, int]:
    """Runs inside the engine's worker: bytes of every LoRA slot buffer, by wrapper class."""
    import torch

    manager = worker.model_runner.lora_manager._adapter_manager
    found: dict[str, int] = {}
    for module in manager.modules.values():
        for name in ("lora_a_stacked", "lora_b_stacked"):
            value = getattr(module, name, None)
            tensors = value if isinstance(value, (tuple, list)) else [value]
            size = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            kind = type(module).__name__
            found[kind] = found.get(kind, 0) + size
    return found


def _measure_one(stack: str, model_id: str) -> None:
    # The engine in this process, so the worker's buffers are read directly, not through a pickle.
    llm = start_engine(stack, model_id, {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    [by_kind] = llm.collective_rpc(slot_bytes_of_worker)
    print(f"{RESULT_PREFIX}{json.dumps(by_kind)}", flush=True)


def measure(stack: str) -> list[dict[str, Any]]:
    from infra.plan.planner import plan_stack
    from infra.spec.schema import CpuNodeGroup
    from infra.spec.stack_file import load_stack

    spec = load_stack(stack)
    plans = {p.model_id: p for p in plan_stack(spec).models}
    results: list[dict[str, Any]] = []
    for model in spec.models:
        if model.lora is None:
            continue
        if not isinstance(spec.node_group(model.node_group), CpuNodeGroup):
            results.append({"model": model.id, "skipped": "GPU model: needs a GPU to measure"})
            continue
        print(f"starting CPU vLLM with LoRA for {model.id} ...", file=sys.stderr, flush=True)
        reported = child_result(
            "ops.benchmarks.lora_memory",
            stack,
            model.id,
            RESULT_PREFIX,
            env={"VLLM_LOGGING_LEVEL": "WARNING"},
            timeout_s=None,
            check_exit=False,
        )
        by_kind = json.loads(reported)
        measured = sum(by_kind.values())
        lora = plans[model.id].lora
        assert lora is not None
        results.append(
            {
                "model": model.id,
                "planned_bytes": lora.slots_per_rank,
                "measured_bytes": measured,
                "by_module": by_kind,
                "ratio": lora.slots_per_rank / measured if measured else None,
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", default="local")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
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
            print(f"{r['model']}: planned {r['planned_bytes']:,} B, vLLM {r['measured_bytes']:,} B ({r['by_module']})")


if __name__ == "__main__":
    main()
