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
import os
import subprocess
import sys
from typing import Any

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
    from infra.render.serve_config import llm_config
    from infra.spec.stack_file import load_stack

    spec = load_stack(stack)
    config = llm_config(spec.model(model_id), spec)
    os.environ.update(config.get("runtime_env", {}).get("env_vars", {}))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The engine in this process, so the worker's buffers are read directly, not through a pickle.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import dataclasses

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    engine_kwargs = {k: v for k, v in config["engine_kwargs"].items() if k in engine_fields}
    llm = LLM(model=config["model_loading_config"]["model_source"], **engine_kwargs)
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
        child = subprocess.run(
            [sys.executable, "-m", "ops.benchmarks.lora_memory", "--stack", stack, "--one", model.id],
            capture_output=True,
            text=True,
            env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
        )
        line = next((ln for ln in child.stdout.splitlines() if ln.startswith(RESULT_PREFIX)), None)
        if line is None:
            raise RuntimeError(f"vLLM did not report its LoRA buffers for {model.id}:\n{child.stderr[-3000:]}")
        by_kind = json.loads(line.removeprefix(RESULT_PREFIX))
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
