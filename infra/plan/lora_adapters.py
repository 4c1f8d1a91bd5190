"""Checks of a LoRA adapter against the model that will serve it, before any replica sees it.

vLLM accepts an adapter only when it loads it (on the first request that names it), and a bad
one then fails that request, or loads and answers with the base's weights (vLLM #18372). So
`llmctl plan` checks each adapter of a local folder, and `llmctl doctor` each adapter in the
model cache, by what the pinned vLLM 0.32.0 itself refuses or silently mis-serves:

- files: `adapter_config.json` and `adapter_model.safetensors` (vllm/lora/lora_model.py
  `from_local_checkpoint` also takes .bin/.pt pickles; we accept safetensors only, since a
  pickle runs code when it loads);
- the base: `base_model_name_or_path` names the model's source, and every tensor has the shape
  that model's layer has (an adapter for another size of the same family has other shapes);
- rank: `r` and every `rank_pattern` value at most `max_lora_rank` (vllm/lora/peft_helper.py
  `validate_legal`), and the features it refuses (DoRA, bias, modules_to_save, ...);
- target modules: each one a linear layer the base has (a Llama-family decoder: vLLM wraps
  q/k/v/o and gate/up/down, and the embeddings);
- dtype: floating point tensors that vLLM casts to the LoRA dtype (an int or fp8 tensor is a
  quantized adapter vLLM does not load).

Pure: `adapter_problems` takes what a reader found (`AdapterFiles`), so tests and both commands
share it. `read_local_adapter` is the one reader of a folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from infra.spec.model_source import local_folder
from infra.spec.schema import Architecture, Lora, LoraAdapter, ModelSpec, same_base_model

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
EMBEDDINGS = ("embed_tokens", "lm_head")
# PEFT names a tensor `base_model.model.<module path>.lora_A.weight` (or lora_B).
TENSOR_NAME = re.compile(r"^base_model\.model\.(?P<path>.+)\.(?P<part>lora_[AB]|lora_embedding_[AB])(\.weight)?$")


class AdapterFiles(BaseModel):
    """What a reader found of one adapter: its config and its tensors' shapes and dtypes."""

    model_config = ConfigDict(frozen=True)

    where: str = Field(description="The folder or S3 prefix read, for messages.")
    config: dict[str, Any] | None = Field(description="adapter_config.json; None when missing or unreadable.")
    has_weights: bool = Field(description="adapter_model.safetensors is there.")
    tensors: dict[str, tuple[list[int], str]] | None = Field(
        description="Tensor name -> (shape, safetensors dtype); None when not read (missing, damaged, or in S3)."
    )


class UnreadableAdapter(ValueError):
    """A weights file that safetensors cannot read."""


class LinearShapes(Protocol):
    """What fixes a Llama-family decoder's linear layers: a spec's Architecture, or the recipe of
    make dev's tiny model (ops.devstack.tiny_model), whose adapters are made with the same shapes."""

    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def module_shapes(arch: LinearShapes) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a Llama-family decoder, unsharded."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
        "lm_head": (h, arch.vocab_size),
    }


def adapter_problems(model: ModelSpec, arch: Architecture, adapter: LoraAdapter, files: AdapterFiles) -> list[str]:
    """Every reason `model` cannot serve `adapter` from `files`, each with its fix; [] when it can."""
    assert model.lora is not None
    lora: Lora = model.lora
    problems: list[str] = []
    if files.config is None:
        problems.append(f"{files.where} has no readable {CONFIG_FILE}: copy the adapter's whole PEFT folder there")
    if not files.has_weights:
        problems.append(
            f"{files.where} has no {WEIGHTS_FILE} (a .bin or .pt pickle is not loaded: convert it with "
            "safetensors, e.g. PEFT's save_pretrained(safe_serialization=True))"
        )
    if files.config is None:
        return problems
    config = files.config
    trained_on = str(config.get("base_model_name_or_path") or "")
    if not same_base_model(trained_on, adapter.base_model):
        problems.append(
            f"its {CONFIG_FILE} says it was trained on {trained_on or '(nothing)'!r}, not on {adapter.base_model!r}: "
            "an adapter only fits the base it was trained on; serve it on a model with that source"
        )
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} is not LoRA: vLLM serves LoRA adapters only")
    ranks = [int(config.get("r") or 0), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    if max(ranks) > lora.max_lora_rank:
        problems.append(
            f"rank {max(ranks)} is above lora.max_lora_rank {lora.max_lora_rank} (vLLM refuses it at load): raise "
            f"max_lora_rank to {_rank_at_least(max(ranks))} (more GPU memory per slot, `llmctl plan` shows it)"
        )
    problems += _unsupported_features(config)
    problems += _target_problems(config, arch)
    if files.tensors is not None:
        problems += _tensor_problems(files.tensors, arch)
    return problems


def _rank_at_least(rank: int) -> int:
    from infra.spec.schema import LORA_RANKS

    return min((r for r in LORA_RANKS if r >= rank), default=LORA_RANKS[-1])


def _unsupported_features(config: dict[str, Any]) -> list[str]:
    """What vllm/lora/peft_helper.py `_validate_features` and `validate_legal` refuse (0.32.0)."""
    found = []
    if config.get("use_dora"):
        found.append("DoRA (use_dora)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        found.append(f"a bias (bias {config.get('bias')!r})")
    saved = [m for m in config.get("modules_to_save") or [] if m not in ("classifier", "score")]
    if saved:
        found.append(f"full copies of {saved} (modules_to_save)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower() not in ("gaussian", "eva", "orthogonal", "mica", "lora_ga"):
        found.append(f"init_lora_weights {init!r}, which changes the base weights")
    for key, what in (("layer_replication", "layer replication"), ("alora_invocation_tokens", "activated LoRA")):
        if config.get(key):
            found.append(what)
    if not found:
        return []
    return [f"vLLM does not serve {', '.join(found)}: retrain or convert it to a plain LoRA adapter"]


def _target_problems(config: dict[str, Any], arch: Architecture) -> list[str]:
    targets = config.get("target_modules") or []
    if isinstance(targets, str):  # PEFT also takes a regex or "all-linear"
        return []
    has = (*ATTENTION, *MLP, *EMBEDDINGS)
    unknown = sorted(t for t in targets if t.rsplit(".", 1)[-1] not in has)
    if not unknown:
        return []
    return [
        f"target modules {unknown} are not layers of the base (a Llama-family decoder has {', '.join(has)}): "
        "it was trained on another architecture; serve it on its own base"
    ]


def _tensor_problems(tensors: dict[str, tuple[list[int], str]], arch: Architecture) -> list[str]:
    shapes = module_shapes(arch)
    wrong_dtype = sorted({dtype for _, dtype in tensors.values() if dtype not in FLOAT_DTYPES})
    problems = []
    if wrong_dtype:
        problems.append(
            f"its tensors are {', '.join(wrong_dtype)}: vLLM loads float16, bfloat16 or float32 adapters only; "
            "save it unquantized"
        )
    mismatched = []
    for name, (shape, _) in sorted(tensors.items()):
        match = TENSOR_NAME.match(name)
        module = match["path"].rsplit(".", 1)[-1] if match else None
        layer = re.search(r"\.layers\.(\d+)\.", name)
        if layer and int(layer[1]) >= arch.num_hidden_layers:
            mismatched.append(f"{name} (layer {layer[1]}, the base has {arch.num_hidden_layers})")
            continue
        if match is None or module not in shapes or len(shape) != 2:
            continue
        fan_in, fan_out = shapes[module]
        expected = shape[0] if match["part"] == "lora_B" else shape[1]
        wanted = fan_out if match["part"] == "lora_B" else fan_in
        if expected != wanted:
            mismatched.append(f"{name} {shape} (the base's {module} is {fan_in} -> {fan_out})")
    if mismatched:
        shown = "; ".join(mismatched[:3]) + (f"; and {len(mismatched) - 3} more" if len(mismatched) > 3 else "")
        problems.append(f"its tensors do not fit the base's layers: {shown}; it was trained on another size of model")
    return problems


def read_local_adapter(source: str) -> AdapterFiles:
    """Read an adapter folder's config and tensor headers (no tensor data)."""
    folder = local_folder(source)
    config: dict[str, Any] | None = None
    try:
        loaded = json.loads((folder / CONFIG_FILE).read_text())
        config = loaded if isinstance(loaded, dict) else None
    except (OSError, ValueError):
        config = None
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        return AdapterFiles(where=str(folder), config=config, has_weights=False, tensors=None)
    try:
        tensors = tensor_headers(weights)
    except Exception as exc:  # noqa: BLE001 (safetensors raises its own error types for a damaged file)
        raise UnreadableAdapter(f"{weights} is not a readable safetensors file ({exc}): copy it again") from None
    return AdapterFiles(where=str(folder), config=config, has_weights=True, tensors=tensors)


def tensor_headers(path: Path) -> dict[str, tuple[list[int], str]]:
    """Each tensor's shape and dtype from a safetensors file's header, read by safetensors itself."""
    from safetensors import safe_open

    headers = {}
    with safe_open(str(path), framework="numpy") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict: `in f` does not iterate)
            tensor = f.get_slice(name)
            headers[name] = (list(tensor.get_shape()), tensor.get_dtype())
    return headers
