"""Make tiny LoRA adapters for the tiny Llama on first run: offline, deterministic, cached.

Why: `make dev` serves adapters through exactly the path a fine-tuned adapter takes in the
cluster (a PEFT folder in S3, fetched by Ray Serve LLM on the first request that names it,
loaded into a vLLM LoRA slot), yet it must download nothing. So each adapter is written the way
PEFT saves one: `adapter_config.json` plus `adapter_model.safetensors` with
`base_model.model.<module>.lora_A.weight` (rank x in) and `lora_B.weight` (out x rank). The
weights are random from a fixed seed, large enough that the adapter changes what the model
answers (an e2e test compares greedy outputs with the base's); peft itself is not needed.

Besides the two named ones `make dev` serves, any number of numbered adapters can be made
(`tiny-llama-a01`, `tiny-llama-a02`, ...: `numbered_adapter`), each from its own fixed seed: the
many-adapter benchmark (`ops.benchmarks.lora_adapters --many`) serves twenty.

Torch and safetensors are imported inside functions, as in `tiny_model`.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from infra.plan.lora_adapters import module_shapes as plan_module_shapes
from ops.devstack.cached_build import ensure_built
from ops.devstack.tiny_model import RECIPES as MODEL_RECIPES
from ops.paths import CACHE_DIR

BUILD_VERSION = "1"
# Llama's linear layers, as PEFT names them, and (in, out) in terms of the model's shape.
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class TinyAdapterRecipe(BaseModel):
    """Everything that determines the bytes of a tiny adapter folder."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base: str = Field("tiny-llama", description="The tiny model it is made for (`tiny_model.RECIPES`).")
    rank: int = Field(8, gt=0, description="LoRA rank `r`.")
    lora_alpha: int = Field(16, gt=0, description="PEFT's scale numerator: the update is B A x alpha / r.")
    target_modules: tuple[str, ...] = Field(LLAMA_TARGETS, description="Modules the adapter changes.")
    init_std: float = Field(0.05, gt=0, description="Std of A and B: big enough to change greedy answers.")
    seed: int = Field(description="torch seed; each adapter its own, so their answers differ.")


RECIPES: dict[str, TinyAdapterRecipe] = {
    "tiny-llama-sql": TinyAdapterRecipe(seed=1),
    "tiny-llama-pirate": TinyAdapterRecipe(seed=2, rank=16, lora_alpha=32, target_modules=("q_proj", "v_proj")),
}


# Numbered adapters: rank 8 on every linear layer like `sql`, seeds from 1001 on (apart from the named ones').
NUMBERED = re.compile(r"tiny-llama-a(\d{2,})")
NUMBERED_SEED_BASE = 1000


def numbered_adapter(index: int) -> str:
    """The name of the `index`-th numbered tiny adapter (1 -> `tiny-llama-a01`)."""
    if index < 1:
        raise ValueError(f"numbered tiny adapters start at 1, not {index}")
    return f"tiny-llama-a{index:02d}"


def recipe_for(name: str) -> TinyAdapterRecipe | None:
    """The recipe of a tiny adapter by folder name: a named one, or a numbered one; None otherwise."""
    if name in RECIPES:
        return RECIPES[name]
    numbered = NUMBERED.fullmatch(name)
    if numbered is None or int(numbered.group(1)) < 1:
        return None
    return TinyAdapterRecipe(seed=NUMBERED_SEED_BASE + int(numbered.group(1)))


def tiny_adapters_dir() -> Path:
    """Default folder of the tiny adapters: `.cache/llmstack/adapters`."""
    return CACHE_DIR / "adapters"


def recipe_hash(recipe: TinyAdapterRecipe) -> str:
    h = hashlib.sha256()
    for part in (BUILD_VERSION, recipe.model_dump_json(), MODEL_RECIPES[recipe.base].model_dump_json()):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def ensure_tiny_adapter(cache_dir: Path | None = None, *, name: str) -> Path:
    """Return `<cache_dir>/<name>`, building it first unless its marker matches the recipe; built in
    a temp folder beside it and renamed into place, like `tiny_model.ensure_tiny_model`."""
    recipe = recipe_for(name)
    if recipe is None:
        raise ValueError(f"unknown tiny adapter {name!r}; known: {sorted(RECIPES)} and tiny-llama-a01, -a02, ...")
    cache_dir = Path(cache_dir) if cache_dir is not None else tiny_adapters_dir()
    return ensure_built(cache_dir / name, recipe_hash(recipe), lambda folder: write_adapter(folder, recipe))


def module_shapes(base: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each Llama linear layer of a tiny model an adapter may target: the
    planner's shapes (which the adapter checks compare against), without the output head."""
    shapes = plan_module_shapes(MODEL_RECIPES[base])
    return {module: shape for module, shape in shapes.items() if module != "lm_head"}


def adapter_config(recipe: TinyAdapterRecipe) -> dict[str, object]:
    """The fields of PEFT's `LoraConfig` that loaders read (vLLM's `PEFTHelper`)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": recipe.base,
        "r": recipe.rank,
        "lora_alpha": recipe.lora_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(recipe.target_modules),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_adapter(out: Path, recipe: TinyAdapterRecipe) -> None:
    """Write the PEFT folder of `recipe` into `out` (tests also write broken variants with it)."""
    import torch
    from safetensors.torch import save_file

    shapes = module_shapes(recipe.base)
    layers = MODEL_RECIPES[recipe.base].num_hidden_layers
    dtype = getattr(torch, MODEL_RECIPES[recipe.base].dtype)
    tensors = {}
    generator = torch.Generator().manual_seed(recipe.seed)
    for layer in range(layers):
        for module in recipe.target_modules:
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = shapes[module]
            a = torch.randn(recipe.rank, fan_in, generator=generator) * recipe.init_std
            b = torch.randn(fan_out, recipe.rank, generator=generator) * recipe.init_std
            tensors[f"{prefix}.lora_A.weight"] = a.to(dtype).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.to(dtype).contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(recipe), indent=2, sort_keys=True) + "\n")
    for path in (out, *out.iterdir()):
        path.chmod(0o755 if path.is_dir() else 0o644)
