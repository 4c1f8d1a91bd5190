"""The planner's LoRA slot memory against the buffers CPU vLLM itself allocates for the local
stack's tiny-chat (enable_lora, max_loras, max_lora_rank as rendered): equal to the byte. An
offline engine of its own: the slot buffers live inside the engine process, which the shared
stack's Ray workers do not expose."""

from __future__ import annotations

import pytest

from ops.benchmarks.lora_memory import measure

pytestmark = pytest.mark.slow


def test_planned_lora_slots_equal_cpu_vllms_buffers():
    [result] = measure("local")
    assert result["model"] == "tiny-chat"
    assert result["planned_bytes"] == result["measured_bytes"] > 0, result
    # Every kind of wrapper vLLM made is one the planner counts (linear layers, embeddings, lm_head).
    assert set(result["by_module"]) == {
        "MergedQKVParallelLinearWithLoRA",
        "RowParallelLinearWithLoRA",
        "MergedColumnParallelLinearWithLoRA",
        "VocabParallelEmbeddingWithLoRA",
        "LogitsProcessorWithLoRA",
    }
