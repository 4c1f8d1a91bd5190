"""Model shapes the capacity planner needs, and where they come from.

In order: the stack's explicit `architecture:`, the `config.json` of a local model folder,
or a built-in table of common open-weight checkpoints. We never fetch from a hub: `plan`
must work offline and before any GPU exists.

Built-in figures are the fields of each checkpoint's published `config.json` on its
Hugging Face model page; parameter counts are computed from them (see `count_parameters`)
and agree with the counts the model cards state.
"""

from __future__ import annotations

import json
from pathlib import Path

from infra.spec.model_source import is_local_path, resolve_local_source
from infra.spec.schema import Architecture, Dtype, ModelSpec


class UnknownModelError(ValueError):
    pass


def count_parameters(
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    intermediate: int,
    vocab: int,
    tied: bool,
    qkv_bias: bool = False,
    qk_norm: bool = False,
) -> int:
    """Parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3): GQA attention + SwiGLU MLP."""
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o: heads; k, v: kv heads
    if qkv_bias:
        attention += head_dim * (heads + 2 * kv_heads)
    if qk_norm:  # Qwen3 normalises each query and key head: one weight per head dim for each
        attention += 2 * head_dim
    mlp = 3 * hidden * intermediate  # gate, up, down
    norms = 2 * hidden
    embeddings = vocab * hidden * (1 if tied else 2)
    return layers * (attention + mlp + norms) + hidden + embeddings


def _arch(
    layers: int,
    heads: int,
    kv: int,
    hidden: int,
    inter: int,
    vocab: int,
    positions: int,
    *,
    head_dim: int | None = None,
    tied: bool = False,
    qkv_bias: bool = False,
    qk_norm: bool = False,
) -> Architecture:
    head_dim = head_dim or hidden // heads
    params = count_parameters(
        layers=layers,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        hidden=hidden,
        intermediate=inter,
        vocab=vocab,
        tied=tied,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
    )
    return Architecture(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=inter,
        vocab_size=vocab,
        parameters=params,
        torch_dtype=Dtype.BFLOAT16,
        max_position_embeddings=positions,
    )


_LLAMA31_8B = _arch(32, 32, 8, 4096, 14336, 128256, 131072)
_LLAMA3_8B = _arch(32, 32, 8, 4096, 14336, 128256, 8192)
_LLAMA31_70B = _arch(80, 64, 8, 8192, 28672, 128256, 131072)
_LLAMA3_70B = _arch(80, 64, 8, 8192, 28672, 128256, 8192)
_QWEN25_7B = _arch(28, 28, 4, 3584, 18944, 152064, 32768, qkv_bias=True)
_QWEN25_72B = _arch(80, 64, 8, 8192, 29568, 152064, 32768, qkv_bias=True)
_QWEN3_06B = _arch(28, 16, 8, 1024, 3072, 151936, 40960, head_dim=128, tied=True, qk_norm=True)
_QWEN3_8B = _arch(36, 32, 8, 4096, 12288, 151936, 40960, head_dim=128, qk_norm=True)
_QWEN3_32B = _arch(64, 64, 8, 5120, 25600, 151936, 40960, head_dim=128, qk_norm=True)
_MISTRAL_7B = _arch(32, 32, 8, 4096, 14336, 32768, 32768)

BUILTIN: dict[str, Architecture] = {
    "meta-llama/Llama-3.1-8B": _LLAMA31_8B,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA31_8B,
    "meta-llama/Meta-Llama-3-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Llama-3.1-70B-Instruct": _LLAMA31_70B,
    "meta-llama/Llama-3.3-70B-Instruct": _LLAMA31_70B,
    "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic": _LLAMA31_70B,  # set `quantization: fp8`
    "meta-llama/Meta-Llama-3-70B-Instruct": _LLAMA3_70B,
    "Qwen/Qwen2.5-7B-Instruct": _QWEN25_7B,
    "Qwen/Qwen2.5-72B-Instruct": _QWEN25_72B,
    "Qwen/Qwen3-0.6B": _QWEN3_06B,
    "Qwen/Qwen3-8B": _QWEN3_8B,
    "Qwen/Qwen3-32B": _QWEN3_32B,
    "mistralai/Mistral-7B-Instruct-v0.3": _MISTRAL_7B,
}


def from_config_json(path: Path) -> Architecture:
    """Read a Hugging Face `config.json` of a Llama-family model."""
    cfg = json.loads(path.read_text())
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    kv = cfg.get("num_key_value_heads") or heads
    tied = bool(cfg.get("tie_word_embeddings", False))
    qkv_bias = bool(cfg.get("attention_bias", False)) or cfg.get("model_type") == "qwen2"
    params = count_parameters(
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        hidden=hidden,
        intermediate=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        tied=tied,
        qkv_bias=qkv_bias,
        qk_norm=cfg.get("model_type") == "qwen3",
    )
    dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    return Architecture(
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        parameters=params,
        torch_dtype=Dtype(dtype_name),
        max_position_embeddings=cfg.get("max_position_embeddings"),
    )


def architecture_for(model: ModelSpec) -> Architecture:
    """The shape of a stack model, or `UnknownModelError` saying how to provide it."""
    if model.architecture is not None:
        return model.architecture
    return architecture_of_source(model.source, subject=f"model {model.id!r}")


def architecture_of_source(source: str, *, subject: str) -> Architecture:
    if is_local_path(source):
        config = Path(resolve_local_source(source)) / "config.json"
        if config.is_file():
            return from_config_json(config)
        raise UnknownModelError(f"{subject}: {config} does not exist; point source at a Hugging Face model folder")
    if source in BUILTIN:
        return BUILTIN[source]
    raise UnknownModelError(
        f"{subject}: cannot tell the shape of {source!r} (not a local folder with config.json, "
        f"not a built-in: {', '.join(sorted(BUILTIN))}); add an `architecture:` block with the "
        "fields of its config.json"
    )
