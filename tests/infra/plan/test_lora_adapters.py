"""A corpus of bad LoRA adapters, one per failure class: `llmctl plan` refuses each with a message
naming the stack file, the adapter and the fix, so none reaches a replica; a good one passes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from infra.plan.lora_adapters import WEIGHTS_FILE
from infra.plan.planner import Reason, plan_stack
from infra.spec.stack_file import PROJECT_ROOT, spec_from_document
from ops.devstack.tiny_adapter import RECIPES, write_adapter

TINY = str(PROJECT_ROOT / ".cache" / "llmstack" / "models" / "tiny-llama")


def local_stack(adapter_folder: Path, *, max_lora_rank: int = 16):
    doc = {
        "config": {
            "llmstack:cloud": {"provider": "local"},
            "llmstack:redis": {"mode": "local"},
            "llmstack:node_groups": [{"name": "local", "kind": "cpu", "max_size": 1, "cpus_per_node": 6}],
            "llmstack:models": [
                {
                    "id": "tiny-chat",
                    "source": TINY,
                    "node_group": "local",
                    "max_model_len": 512,
                    "dtype": "float32",
                    "lora": {
                        "max_lora_rank": max_lora_rank,
                        "adapters": [{"id": "support", "source": str(adapter_folder), "base_model": "tiny-llama"}],
                    },
                }
            ],
        }
    }
    return spec_from_document(doc, name="corpus", file_label="Pulumi.corpus.yaml")


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def retyped_weights(folder: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / WEIGHTS_FILE))
    save_file({k: v.to(getattr(torch, dtype)) for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))


def other_width(folder: Path) -> None:
    """Tensors of a wider model of the same family (hidden 512): trained on another size."""
    import torch
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / WEIGHTS_FILE))
    save_file({k: torch.zeros(v.shape[0] * 2, v.shape[1] * 2) for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))


CORPUS: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "no adapter_config.json": (lambda f: (f / "adapter_config.json").unlink(), ["no readable adapter_config.json"]),
    "no weights": (lambda f: (f / WEIGHTS_FILE).unlink(), ["no adapter_model.safetensors", "convert it"]),
    "a pickle instead of safetensors": (
        lambda f: (f / WEIGHTS_FILE).rename(f / "adapter_model.bin"),
        ["no adapter_model.safetensors", "pickle is not loaded"],
    ),
    "trained on another base": (
        lambda f: edit_config(f, base_model_name_or_path="Qwen/Qwen3-0.6B"),
        ["trained on 'Qwen/Qwen3-0.6B', not on 'tiny-llama'", "serve it on a model with that source"],
    ),
    "rank above max_lora_rank": (lambda f: edit_config(f, r=32), ["rank 32 is above", "raise max_lora_rank to 32"]),
    "a rank_pattern above max_lora_rank": (
        lambda f: edit_config(f, rank_pattern={"q_proj": 64}),
        ["rank 64 is above", "raise max_lora_rank to 64"],
    ),
    "target modules the base lacks": (
        lambda f: edit_config(f, target_modules=["query_key_value", "dense"]),
        ["target modules ['dense', 'query_key_value'] are not layers of the base"],
    ),
    "int8 tensors": (lambda f: retyped_weights(f, "int8"), ["tensors are I8", "save it unquantized"]),
    "tensors of another model size": (other_width, ["do not fit the base's layers", "another size of model"]),
    "DoRA": (lambda f: edit_config(f, use_dora=True), ["vLLM does not serve DoRA"]),
    "a cut-off weights file": (
        lambda f: (f / WEIGHTS_FILE).write_bytes((f / WEIGHTS_FILE).read_bytes()[:1000]),
        ["is not a readable safetensors file", "copy it again"],
    ),
}


@pytest.fixture
def good_adapter(tmp_path: Path) -> Path:
    folder = tmp_path / "support"
    write_adapter(folder, RECIPES["tiny-llama-sql"])
    return folder


def test_a_good_adapter_passes(good_adapter: Path):
    plan = plan_stack(local_stack(good_adapter))
    assert plan.ok, plan.problems


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_each_bad_adapter_is_refused_with_the_file_the_adapter_and_the_fix(good_adapter: Path, case: str):
    spoil, expected = CORPUS[case]
    spoil(good_adapter)
    plan = plan_stack(local_stack(good_adapter))
    refused = [p for p in plan.problems if p.reason is Reason.BAD_LORA_ADAPTER]
    assert refused, f"{case}: accepted"
    assert {p.subject for p in refused} == {"tiny-chat:support"}
    message = " | ".join(p.message for p in refused)
    assert message.startswith("Pulumi.corpus.yaml, model 'tiny-chat', lora adapter 'support': ")
    for part in expected:
        assert part in message, (case, message)
    # Nothing else is wrong with the stack: the adapter alone is refused.
    assert all(p.reason is Reason.BAD_LORA_ADAPTER for p in plan.problems)


def test_a_rank_that_fits_a_larger_max_lora_rank_passes(good_adapter: Path):
    edit_config(good_adapter, r=32)
    assert not plan_stack(local_stack(good_adapter, max_lora_rank=32)).problems
