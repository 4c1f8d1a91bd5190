"""How vLLM's V1 engine splits one GPU's memory before it sizes the KV cache, term by term.

vLLM does not read a formula: each engine rank loads the weights, runs one profiling forward
pass and measures. This module predicts what those measurements come to, for the vLLM release
named (each term cites the vLLM source it follows), so `llmctl plan` can say how many KV tokens
a replica gets, and refuse what the engine would refuse, before any GPU exists.

Per rank, as `Worker.determine_available_memory` (vllm/v1/worker/gpu_worker.py) computes it:

    requested  = ceil(driver-visible total x gpu_memory_utilization)
    kv         = requested - weights - LoRA slots - non-torch increase - activation peak - CUDA graphs
    KV blocks  = kv // (block_size x KV bytes per token on this rank)

The driver-visible totals come from the GPU catalog. Which terms exist, and how large the
activation peak is, depend on the release: `EngineRelease` holds those differences. The
figures that were measured rather than read from code say so where they are defined;
BENCHMARKS.md compares the whole budget with published vLLM logs.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from infra.catalog.gpu_catalog import GpuClassInfo
from infra.spec.schema import Architecture

GIB = 1024**3

# vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE (0.29.0): 16 tokens per block on CUDA.
DEFAULT_BLOCK_SIZE = 16

# Non-torch memory that appears between the engine's first memory snapshot and the end of the
# profiling run (cuBLAS workspaces; with more than one rank, NCCL and custom all-reduce buffers).
# No vLLM code states it; these are the increases vLLM v0.11 measured on H100 in the published
# llm-d runs (config_explorer/empirical-vllm-memory-results.md): 0.13-0.14 GiB on one GPU,
# 0.54-0.55 GiB per rank at tensor parallel 2. The larger of each pair is used.
NON_TORCH_ONE_GPU = int(0.14 * GIB)
NON_TORCH_PER_RANK_SHARDED = int(0.55 * GIB)

# Model runner V1's profiling peak (vllm/v1/worker/gpu_model_runner.py `_dummy_sampler_run`, used
# by V1 engines up to 0.25.0, and later for models runner V2 does not support). Its dummy sampler
# run applies top-k and top-p to every row, so the peak is the sampler's: float32 logits, their
# sort values and int64 indices, softmax and cumulative sums over max_num_seqs x vocabulary, while
# the forward pass's hidden states are still held. The two coefficients were fitted to the
# published llm-d H100 runs of Llama-3.1-8B and Llama-3.3-70B-FP8 TP2 (vLLM v0.11); they reproduce
# the Qwen3-0.6B and Qwen3-32B (TP1, TP2) runs within the logs' 0.01 GiB rounding (BENCHMARKS.md).
SAMPLER_BYTES_PER_LOGIT = 38.26
HIDDEN_BYTES_PER_ELEMENT = 2.56

# vllm/v1/worker/gpu/cudagraph_utils.py `_MIN_PER_GRAPH_BYTES` (0.29.0): the per-graph floor the
# CUDA graph memory estimate extrapolates FULL graphs with.
MIN_BYTES_PER_GRAPH = 1 << 20


class ModelRunner(str, Enum):
    """Which GPU model runner profiles memory: their profiling runs peak in different places."""

    V1 = "v1"  # vllm/v1/worker/gpu_model_runner.py: the sampler run with top-k/top-p dominates
    V2 = "v2"  # vllm/v1/worker/gpu/model_runner.py: a plain sampler; the forward pass dominates


class EngineRelease(BaseModel):
    """What one vLLM release does when it sizes the KV cache on a GPU."""

    model_config = ConfigDict(frozen=True)

    version: str = Field(description="vLLM version, e.g. `0.29.0`.")
    v1_engine: bool = Field(description="The V1 engine is the default (0.8.0 and later).")
    model_runner: ModelRunner = Field(description="The model runner a dense decoder gets by default.")
    subtracts_cudagraphs: bool = Field(
        description="The CUDA graph memory estimate is charged before the KV cache (0.21.0 and later)."
    )


def parse_version(version: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a release string; local and pre-release suffixes are ignored."""
    numbers = [int(re.sub(r"\D.*", "", part) or 0) for part in version.split("+")[0].split(".")[:3]]  # leading digits
    major, minor, patch = (numbers + [0, 0, 0])[:3]
    return major, minor, patch


def engine_release(version: str) -> EngineRelease:
    """The behaviour of the vLLM `version` that matters for memory.

    - V1 engine by default from 0.8.0; older releases ran V0, which captured CUDA graphs after
      sizing the cache and profiled differently: their figures are estimates here.
    - Model runner V2 became the default for dense decoders in 0.25.1 (vLLM PR #49233's account
      of issue #49224); `VllmConfig.use_v2_model_runner` in vllm/config/vllm.py (0.29.0).
    - CUDA graph memory profiling charged by default since 0.21.0: the log line of
      vllm/v1/worker/gpu_worker.py (0.29.0) "CUDA graph memory profiling is enabled (default
      since v0.21.0)", env `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` defaulting to 1.
    """
    v = parse_version(version)
    return EngineRelease(
        version=version,
        v1_engine=v >= (0, 8, 0),
        model_runner=ModelRunner.V2 if v >= (0, 25, 1) else ModelRunner.V1,
        subtracts_cudagraphs=v >= (0, 21, 0),
    )


class BatchLimits(BaseModel):
    max_num_batched_tokens: int = Field(description="Tokens in one forward pass (the profiling run's size).")
    max_num_seqs: int = Field(description="Sequences in one batch (the profiling sampler's rows).")


def batch_limits(gpu: GpuClassInfo, engine_args: dict[str, Any]) -> BatchLimits:
    """The batch limits vLLM's OpenAI server picks unless the engine args set them.

    Ray Serve LLM builds the engine config with `UsageContext.OPENAI_API_SERVER` on a task that
    holds a GPU (ray/llm/_internal/serve/engines/vllm/vllm_engine.py `_get_vllm_engine_config`,
    Ray 2.60), so vLLM's per-GPU defaults apply: `EngineArgs.get_batch_defaults`
    (vllm/engine/arg_utils.py, 0.29.0) gives 16384 / 1024 from 160 GiB, 8192 / 1024 from 70 GiB
    unless the device name says A100, and 2048 / 256 below.
    """
    total = gpu.driver_memory_bytes
    if total >= 160 * GIB:
        tokens, seqs = 16384, 1024
    elif total >= 70 * GIB and "a100" not in gpu.device_name.lower():
        tokens, seqs = 8192, 1024
    else:
        tokens, seqs = 2048, 256
    return BatchLimits(
        max_num_batched_tokens=int(engine_args.get("max_num_batched_tokens", tokens)),
        max_num_seqs=int(engine_args.get("max_num_seqs", seqs)),
    )


class RankMemory(BaseModel):
    """One engine rank's memory as vLLM splits it, in bytes. `kv_cache` is what is left."""

    vllm_version: str = Field(description="The vLLM release these terms model.")
    driver_total: int = Field(description="Total memory the CUDA driver reports for the GPU.")
    requested: int = Field(description="driver_total x gpu_memory_utilization, rounded up.")
    weights: int = Field(description="Weights on this rank, with its rotary-embedding table.")
    lora_slots: int = Field(default=0, description="LoRA slot buffers, made with the model (infra.plan.lora_memory).")
    non_torch: int = Field(description="Non-torch memory added during start-up (cuBLAS, NCCL).")
    activation_peak: int = Field(description="Transient peak of the profiling run.")
    cuda_graphs: int = Field(description="CUDA graph memory estimate charged before the KV cache.")
    kv_cache: int = Field(description="What is left for the KV cache (negative: does not fit).")
    max_num_batched_tokens: int
    max_num_seqs: int


def rotary_table_bytes(arch: Architecture, dtype_bytes: int) -> int:
    """vLLM's `RotaryEmbedding` keeps a cos/sin table of max positions x rotary dim on every rank,
    in the model dtype (vllm/model_executor/layers/rotary_embedding/base.py, 0.29.0)."""
    return (arch.max_position_embeddings or 0) * arch.head_dim * dtype_bytes


def activation_peak_bytes(
    release: EngineRelease, arch: Architecture, limits: BatchLimits, *, dtype_bytes: int, tp: int
) -> int:
    """The transient peak of `profile_run`: a forward pass over max_num_batched_tokens tokens
    (attention skipped) and a sampler run over min(max_num_seqs, tokens) rows of logits."""
    tokens = limits.max_num_batched_tokens
    rows = min(limits.max_num_seqs, tokens)
    if release.model_runner is ModelRunner.V1:
        return int(
            HIDDEN_BYTES_PER_ELEMENT * tokens * arch.hidden_size + SAMPLER_BYTES_PER_LOGIT * rows * arch.vocab_size
        )
    return max(
        forward_peak_bytes(arch, tokens, dtype_bytes=dtype_bytes, tp=tp),
        _v2_sampler_peak_bytes(arch, tokens, rows, dtype_bytes=dtype_bytes, tp=tp),
    )


def forward_peak_bytes(arch: Architecture, tokens: int, *, dtype_bytes: int, tp: int) -> int:
    """Live tensors at the MLP of one decoder layer, the widest point of a forward pass: the
    layer input and the residual stream (hidden each), the fused gate/up projection (2 x MLP
    width / tp) and the activation output (MLP width / tp)."""
    return tokens * dtype_bytes * (2 * arch.hidden_size + 3 * arch.intermediate_size // tp)


def _v2_sampler_peak_bytes(arch: Architecture, tokens: int, rows: int, *, dtype_bytes: int, tp: int) -> int:
    """Model runner V2's dummy sampler (vllm/v1/worker/gpu/model_runner.py `_dummy_sampler_run`,
    0.29.0) samples the model-dtype logits in place with a Triton Gumbel kernel: the hidden states
    are held, plus the logits (and, across ranks, the local shard before the all-gather)."""
    logits = rows * arch.vocab_size * dtype_bytes
    shard = logits // tp if tp > 1 else 0
    return tokens * arch.hidden_size * dtype_bytes + logits + shard


def cuda_graph_bytes(arch: Architecture, limits: BatchLimits, *, dtype_bytes: int, tp: int) -> int:
    """The CUDA graph estimate of `profile_cudagraph_memory` (vllm/v1/worker/gpu/cudagraph_utils.py,
    0.29.0): it captures the graphs into a throwaway pool and measures it. The pool holds the
    intermediates of the largest capture size (captured first, reused by the smaller ones); FULL
    graphs are extrapolated at no less than 1 MiB each. Capture sizes follow
    `VllmConfig._set_cudagraph_sizes`: 1, 2, 4, multiples of 8 below 256, then of 16 up to
    min(2 x max_num_seqs, 512, max_num_batched_tokens)."""
    largest = min(2 * limits.max_num_seqs, 512, limits.max_num_batched_tokens)
    sizes = [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)] if s <= largest]
    return forward_peak_bytes(arch, largest, dtype_bytes=dtype_bytes, tp=tp) + len(sizes) * MIN_BYTES_PER_GRAPH


def rank_memory(
    release: EngineRelease,
    gpu: GpuClassInfo,
    arch: Architecture,
    *,
    weights_per_rank: int,
    dtype_bytes: int,
    tp: int,
    gpus: int,
    gpu_memory_utilization: float,
    engine_args: dict[str, Any],
    lora_slots: int = 0,
) -> RankMemory:
    """Every term of one rank's memory, for `release` on `gpu` (see the module docstring).
    `lora_slots`: the LoRA buffers vLLM allocates with the model (`infra.plan.lora_memory`)."""
    limits = batch_limits(gpu, engine_args)
    requested = math.ceil(gpu.driver_memory_bytes * gpu_memory_utilization)
    weights = weights_per_rank + rotary_table_bytes(arch, dtype_bytes)
    non_torch = NON_TORCH_ONE_GPU if gpus == 1 else NON_TORCH_PER_RANK_SHARDED
    activation = activation_peak_bytes(release, arch, limits, dtype_bytes=dtype_bytes, tp=tp)
    eager = bool(engine_args.get("enforce_eager", False))
    graphs = (
        cuda_graph_bytes(arch, limits, dtype_bytes=dtype_bytes, tp=tp)
        if release.subtracts_cudagraphs and not eager
        else 0
    )
    kv = requested - weights - lora_slots - non_torch - activation - graphs
    if "kv_cache_memory_bytes" in engine_args:  # vLLM then skips profiling and takes this figure
        kv = int(engine_args["kv_cache_memory_bytes"])
    return RankMemory(
        vllm_version=release.version,
        driver_total=gpu.driver_memory_bytes,
        requested=requested,
        weights=weights,
        lora_slots=lora_slots,
        non_torch=non_torch,
        activation_peak=activation,
        cuda_graphs=graphs,
        kv_cache=kv,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        max_num_seqs=limits.max_num_seqs,
    )


def kv_tokens(kv_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Tokens in whole blocks: `get_kv_cache_config_from_groups` (vllm/v1/core/kv_cache_utils.py,
    0.29.0) divides the memory by the bytes of one block across all layers."""
    if kv_bytes <= 0:
        return 0
    return kv_bytes // (kv_bytes_per_token * block_size) * block_size
