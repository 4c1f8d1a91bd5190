"""LoRA slot memory as vLLM 0.32.0 allocates it, and its place in a GPU's budget."""

from __future__ import annotations

from infra.plan.lora_memory import lora_memory, lora_slot_elements
from infra.plan.model_arch import BUILTIN
from infra.plan.planner import plan_stack
from infra.spec.schema import Lora
from infra.spec.stack_file import load_stack, spec_from_document
from tests.support.stacks import stack_document

LLAMA_8B = BUILTIN["meta-llama/Llama-3.1-8B-Instruct"]
ADAPTER = {"id": "support", "source": "s3://adapters/support", "base_model": "meta-llama/Llama-3.1-8B-Instruct"}


def test_the_linear_layers_of_llama_8b_at_rank_16_are_peft_s_published_count():
    """PEFT reports 41,943,040 trainable parameters for r=16 on every linear layer of Llama-3-8B;
    vLLM's slots add the embeddings and lm_head (vocab + hidden each, times the rank)."""
    embeddings_and_head = 2 * 16 * (128256 + 4096)
    assert lora_slot_elements(LLAMA_8B, 16) == 41_943_040 + embeddings_and_head


def test_slots_grow_with_max_loras_and_the_host_cache_with_max_cpu_loras():
    lora = Lora(max_loras=4, max_lora_rank=16, max_cpu_loras=8, adapters=[ADAPTER])
    memory = lora_memory(LLAMA_8B, lora, dtype_bytes=2)
    assert memory.slot_bytes_per_adapter == 2 * lora_slot_elements(LLAMA_8B, 16)
    assert memory.slots_per_rank == 4 * memory.slot_bytes_per_adapter
    assert memory.cpu_cache_bytes_max == 8 * memory.slot_bytes_per_adapter


def test_tensor_parallel_ranks_hold_their_shard_of_the_sharded_side_only():
    whole, half = lora_slot_elements(LLAMA_8B, 16), lora_slot_elements(LLAMA_8B, 16, tp=2)
    assert whole / 2 < half < whole


def test_the_local_tiny_chat_slots_are_what_cpu_vllm_allocated():
    """1,400,576 bytes: the sum of CPU vLLM 0.32.0's slot buffers for tiny-chat (python -m
    ops.benchmarks.lora_memory --stack local; tests/e2e/test_lora_memory_vs_vllm.py checks it live)."""
    [chat] = [m for m in plan_stack(load_stack("local")).models if m.model_id == "tiny-chat"]
    assert chat.lora is not None and chat.lora.slots_per_rank == 1_400_576


def test_on_a_gpu_the_slots_come_out_of_the_kv_cache():
    def plan(**lora):
        model = {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 8192}
        doc = stack_document(models=[{**model, **({"lora": lora} if lora else {})}])
        [m] = plan_stack(spec_from_document(doc, name="test", file_label="Pulumi.test.yaml")).models
        return m

    without, with_lora = plan(), plan(max_loras=4, max_lora_rank=64, adapters=[ADAPTER])
    assert with_lora.gpu_memory is not None and without.gpu_memory is not None and with_lora.lora is not None
    assert with_lora.gpu_memory.lora_slots == with_lora.lora.slots_per_rank > 0
    assert without.gpu_memory.kv_cache - with_lora.gpu_memory.kv_cache == with_lora.lora.slots_per_rank
    assert with_lora.kv_tokens_per_replica < without.kv_tokens_per_replica
