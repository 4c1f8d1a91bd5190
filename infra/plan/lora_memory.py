"""The memory a model's LoRA settings take on each rank, as the pinned vLLM (0.32.0) allocates it.

With `enable_lora`, vLLM wraps every layer LoRA can change when it loads the model
(vllm/lora/model_manager.py `_create_lora_modules`: with no `target_modules` in the engine
config, every supported module of the model) and gives each wrapper its stacked slot buffers,
zeros of the LoRA dtype (the model's dtype) that stay for the engine's life, whatever adapters
arrive later:

    lora_a_stacked  max_loras x 1 x max_lora_rank x in      one per packed slice
    lora_b_stacked  max_loras x 1 x out x max_lora_rank     one per packed slice

(`BaseLinearLayerWithLoRA.create_lora_weights` in vllm/lora/layers/base_linear.py and its merged
column-parallel override). For a Llama-family decoder the wrapped modules are, per layer,
`qkv_proj` (three slices: q, k, v), `o_proj`, `gate_up_proj` (two slices) and `down_proj`, plus
`embed_tokens` (A: vocab x rank, B: hidden x rank; vllm/lora/layers/vocab_parallel_embedding.py)
and `lm_head` (A: rank x hidden, B: vocab x rank; vllm/lora/layers/logits_processor.py), because
vLLM's Llama lists both as `embedding_modules`. Under tensor parallelism a column-parallel layer's
B and a row-parallel layer's A hold this rank's shard only (`output_size` and `input_size` are per
partition); the embedding and lm_head slots are whole on every rank.

The buffers exist before the profiling run, so on a GPU they come out of the KV cache's share
(`infra.plan.vllm_memory.rank_memory` takes them). The warm-up adapters vLLM adds while
profiling are made on the CPU (`create_dummy_lora(..., "cpu")`) and copied into these same slots:
no further GPU memory. Adapters kept for swapping in (`max_cpu_loras`) live in host memory, each
its own rank's size; `cpu_cache_bytes_max` bounds them at `max_lora_rank`.

An exactness test builds CPU vLLM's engine for the tiny model and sums its slot buffers
(tests/e2e/test_lora_memory_vs_vllm.py).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from infra.spec.schema import Architecture, Lora


class LoraMemory(BaseModel):
    """One rank's LoRA memory, in bytes."""

    slots_per_rank: int = Field(description="The stacked A/B slot buffers of every wrapped module on one rank.")
    slot_bytes_per_adapter: int = Field(description="One adapter slot's share of slots_per_rank.")
    cpu_cache_bytes_max: int = Field(
        description="Host memory of max_cpu_loras adapters at max_lora_rank (an upper bound: each is its own rank)."
    )


def lora_slot_elements(arch: Architecture, rank: int, *, tp: int = 1) -> int:
    """Elements of one adapter slot of width `rank` across all wrapped modules of one rank."""
    h, i, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q = arch.num_attention_heads * arch.head_dim
    kv = arch.num_key_value_heads * arch.head_dim
    # vLLM replicates a KV head on ranks beyond their count; each rank then holds one head.
    kv_shard = max(kv // tp, arch.head_dim)
    per_layer = (
        3 * rank * h
        + rank * (q // tp + 2 * kv_shard)  # qkv_proj: A per slice (in = hidden), B per slice shard
        + rank * (q // tp)
        + h * rank  # o_proj: row parallel, A's input sharded
        + 2 * rank * h
        + 2 * (i // tp) * rank  # gate_up_proj: two slices
        + rank * (i // tp)
        + h * rank  # down_proj: row parallel
    )
    embeddings = v * rank + h * rank  # embed_tokens: A vocab x rank, B hidden x rank
    lm_head = rank * h + v * rank
    return arch.num_hidden_layers * per_layer + embeddings + lm_head


def lora_memory(arch: Architecture, lora: Lora, *, dtype_bytes: int, tp: int = 1) -> LoraMemory:
    """LoRA memory per rank for a model of shape `arch` whose LoRA dtype has `dtype_bytes`."""
    per_adapter = lora_slot_elements(arch, lora.max_lora_rank, tp=tp) * dtype_bytes
    # Host copies are whole adapters (not sharded): the tp=1 size.
    whole = lora_slot_elements(arch, lora.max_lora_rank) * dtype_bytes
    return LoraMemory(
        slots_per_rank=lora.max_loras * per_adapter,
        slot_bytes_per_adapter=per_adapter,
        cpu_cache_bytes_max=lora.cpu_loras * whole,
    )
