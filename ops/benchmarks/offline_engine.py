"""The planner-vs-vLLM benchmarks' shared half: vLLM's offline engine started in a child process
with exactly the engine settings the stack renders for one model, and the child's one-line answer.

    python -m ops.benchmarks.<benchmark> --stack S --one MODEL   # the child: start_engine, print a line
    payload = child_result("ops.benchmarks.<benchmark>", S, MODEL, PREFIX)   # the parent
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any


def start_engine(stack: str, model_id: str, extra_env: dict[str, str] | None = None) -> Any:
    """vLLM's `LLM` for `model_id` of `stack`, with the environment and the engine arguments its
    rendered Serve config gives the replica (`extra_env` on top, before vLLM is imported)."""
    from infra.render.serve_config import llm_config
    from infra.spec.stack_file import load_stack

    spec = load_stack(stack)
    config = llm_config(spec.model(model_id), spec)
    os.environ.update(config.get("runtime_env", {}).get("env_vars", {}))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.update(extra_env or {})
    import dataclasses

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    # Ray Serve LLM's engine_kwargs also carry vLLM's OpenAI-server options (e.g.
    # enable_prompt_tokens_details), which the offline engine does not take.
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    engine_kwargs = {k: v for k, v in config["engine_kwargs"].items() if k in engine_fields}
    return LLM(model=config["model_loading_config"]["model_source"], **engine_kwargs)


def child_result(
    module: str,
    stack: str,
    model_id: str,
    prefix: str,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float | None = 600,
    check_exit: bool = True,
) -> str:
    """Run `python -m module --stack stack --one model_id` and return what follows `prefix` on its
    last line that starts with it; RuntimeError with the child's stderr when there is none (or,
    with `check_exit`, when the child exited non-zero)."""
    child = subprocess.run(
        [sys.executable, "-m", module, "--stack", stack, "--one", model_id],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
    found = [line for line in child.stdout.splitlines() if line.startswith(prefix)]
    if not found or (check_exit and child.returncode != 0):
        raise RuntimeError(f"vLLM failed for {model_id} (exit {child.returncode}):\n" + child.stderr[-3000:])
    return found[-1].removeprefix(prefix)
