"""Capacity planner: hand-checked figures, and each refusal with its reason."""

from __future__ import annotations

import math

import pytest

from infra.catalog.versions import CLUSTER_VLLM_VERSION
from infra.plan.model_arch import BUILTIN, count_parameters
from infra.plan.planner import Reason, kv_bytes_per_token, plan_stack
from infra.spec.stack_file import PROJECT_ROOT, load_stack, spec_from_document
from tests.support.stacks import stack_document

LLAMA_8B = BUILTIN["meta-llama/Llama-3.1-8B-Instruct"]
GIB = 1024**3


def plan_of(**overrides):
    return plan_stack(spec_from_document(stack_document(**overrides), name="t", file_label="Pulumi.t.yaml"))


def model(**fields):
    base = {"id": "m", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "g", "max_model_len": 8192}
    return {**base, **fields}


def group(instance: str, max_size: int = 4, **fields):
    return {"name": "g", "kind": "gpu", "instance_type": instance, "max_size": max_size, **fields}


def reasons(plan) -> set[Reason]:
    return {p.reason for p in plan.problems}


def test_parameter_counts_match_model_cards():
    # Model cards: Llama 3.1 8B has 8,030,261,248 parameters; 70B about 70.6B; Qwen2.5-7B 7.62B.
    assert LLAMA_8B.parameters == 8_030_261_248
    assert round(BUILTIN["meta-llama/Llama-3.3-70B-Instruct"].parameters / 1e9, 1) == 70.6
    assert round(BUILTIN["Qwen/Qwen2.5-7B-Instruct"].parameters / 1e9, 2) == 7.62
    assert (
        count_parameters(layers=1, heads=1, kv_heads=1, head_dim=2, hidden=2, intermediate=3, vocab=5, tied=True)
        == (2 * 2 * 4) + 3 * 2 * 3 + 2 * 2 + 2 + 5 * 2
    )


def test_llama_8b_bf16_needs_128_kib_of_kv_per_token():
    # 32 layers x 8 KV heads x 128 head dim x (K, V) x 2 bytes = 131,072 bytes.
    assert kv_bytes_per_token(LLAMA_8B, 2) == 128 * 1024
    assert kv_bytes_per_token(LLAMA_8B, 2, tp=2) == 64 * 1024
    # Eight ranks over 8 KV heads hold one head each; sixteen ranks replicate, still one each.
    assert kv_bytes_per_token(LLAMA_8B, 2, tp=16) == kv_bytes_per_token(LLAMA_8B, 2, tp=8)
    assert kv_bytes_per_token(LLAMA_8B, 1) == 64 * 1024  # fp8 KV cache


def test_8b_on_one_l4_fits_with_hand_checked_kv_budget():
    plan = plan_of(node_groups=[group("g6.2xlarge")], models=[model()])
    assert plan.ok
    m = plan.models[0]
    assert m.weight_bytes == 2 * 8_030_261_248
    memory = m.gpu_memory
    assert memory.vllm_version == plan.vllm_version == CLUSTER_VLLM_VERSION
    # The L4's driver-visible 22.03 GiB x 0.9, less the weights and the rotary table
    # (131,072 positions x 128 x 2 bytes), less 0.14 GiB non-torch memory, less the profiling
    # forward pass at the OpenAI server's L4 default of 2,048 tokens (2,048 x 2 bytes x
    # (2 x 4,096 + 3 x 14,336)), less the CUDA graph pool (the same at 512 tokens, plus 1 MiB
    # for each of 51 capture sizes).
    assert memory.requested == math.ceil(round(22.03 * GIB) * 0.9)
    assert memory.weights == 2 * 8_030_261_248 + 131_072 * 128 * 2
    assert (memory.max_num_batched_tokens, memory.max_num_seqs) == (2048, 256)
    assert memory.activation_peak == 2048 * 2 * (2 * 4096 + 3 * 14336)
    assert memory.cuda_graphs == 512 * 2 * (2 * 4096 + 3 * 14336) + 51 * 2**20
    kv = memory.requested - memory.weights - memory.non_torch - memory.activation_peak - memory.cuda_graphs
    assert memory.kv_cache == m.kv_cache_bytes_per_rank == kv
    assert m.kv_tokens_per_replica == kv // (128 * 1024 * 16) * 16
    assert m.max_concurrent_sequences == m.kv_tokens_per_replica // 8192


def test_tp_must_divide_attention_heads():
    plan = plan_of(
        node_groups=[group("g6.48xlarge")], models=[model(source="Qwen/Qwen2.5-7B-Instruct", tensor_parallel_size=8)]
    )
    assert reasons(plan) == {Reason.TP_DOES_NOT_DIVIDE_HEADS}
    assert "28 attention heads" in plan.problems[0].message and "[1, 2, 4, 28]" in plan.problems[0].message


def test_replica_larger_than_node_is_refused_unless_pipeline_spans_nodes():
    plan = plan_of(node_groups=[group("g6.12xlarge")], models=[model(tensor_parallel_size=8)])
    assert reasons(plan) == {Reason.REPLICA_EXCEEDS_NODE}
    spanning = plan_of(
        node_groups=[group("g6.12xlarge")], models=[model(tensor_parallel_size=4, pipeline_parallel_size=2)]
    )
    assert spanning.ok and spanning.models[0].nodes_per_replica == 2


def test_weights_that_do_not_fit():
    plan = plan_of(
        node_groups=[group("g6.xlarge")], models=[model(source="meta-llama/Llama-3.3-70B-Instruct", max_model_len=4096)]
    )
    assert Reason.WEIGHTS_DO_NOT_FIT in reasons(plan)
    assert "raise tensor_parallel_size, quantize" in plan.problems[0].message


def test_quantization_shrinks_weights_enough():
    tp4 = model(source="meta-llama/Llama-3.3-70B-Instruct", max_model_len=8192, tensor_parallel_size=4)
    assert not plan_of(node_groups=[group("g6.12xlarge")], models=[tp4]).ok
    assert plan_of(node_groups=[group("g6.12xlarge")], models=[{**tp4, "quantization": "awq"}]).ok


def test_not_even_one_sequence_fits():
    plan = plan_of(node_groups=[group("g6.xlarge")], models=[model(max_model_len=131072)])
    assert reasons(plan) == {Reason.NO_ROOM_FOR_ONE_SEQUENCE}
    assert plan_of(
        node_groups=[group("g6.xlarge")],
        models=[model(max_model_len=131072, kv_cache_dtype="fp8", tensor_parallel_size=1)],
    ).problems


def test_node_group_too_small_for_max_replicas():
    plan = plan_of(
        node_groups=[group("g6.xlarge", max_size=2)], models=[model(autoscaling={"min_replicas": 1, "max_replicas": 3})]
    )
    assert reasons(plan) == {Reason.NODE_GROUP_TOO_SMALL}
    assert "raise max_size of node group 'g' to 3" in plan.problems[0].message


def test_replicas_of_several_models_share_multi_gpu_nodes():
    models = [
        model(id="a", autoscaling={"min_replicas": 1, "max_replicas": 3}),
        model(id="b", autoscaling={"min_replicas": 1, "max_replicas": 1}),
    ]
    plan = plan_of(node_groups=[group("g6.12xlarge", max_size=1)], models=models)  # 4 GPUs per node
    assert plan.ok
    assert (plan.node_groups[0].nodes_at_min, plan.node_groups[0].nodes_at_max) == (1, 1)


def test_blue_green_verdicts():
    def verdict(max_size: int, lo: int, hi: int) -> str:
        scaling = {"min_replicas": lo, "max_replicas": hi}
        return (
            plan_of(node_groups=[group("g6.xlarge", max_size=max_size)], models=[model(autoscaling=scaling)])
            .node_groups[0]
            .blue_green
        )

    assert verdict(4, 1, 2) == "fits"
    assert verdict(4, 2, 4) == "fits only below peak load"
    assert verdict(4, 3, 4).startswith("does not fit")


def test_cost_scales_with_nodes():
    plan = plan_of(node_groups=[group("g6.xlarge")], models=[model(autoscaling={"min_replicas": 1, "max_replicas": 3})])
    m = plan.models[0]
    assert m.usd_per_hour_at_max == pytest.approx(3 * m.usd_per_hour_at_min, abs=0.02)


def test_unknown_architecture_says_how_to_fix():
    plan = plan_of(models=[model(source="acme/secret-model", node_group="l4")])
    assert reasons(plan) == {Reason.UNKNOWN_ARCHITECTURE}
    assert "add an `architecture:` block" in plan.problems[0].message


def test_local_tiny_model_kv_capacity_is_exact():
    # Tiny Llama: 2 layers x 2 KV heads x 64 x (K, V) x 4 bytes (float32) = 2,048 bytes per
    # token; VLLM_CPU_KVCACHE_SPACE=1 GiB holds 524,288 tokens in whole 128-token blocks.
    # vLLM 0.32 (CPU) reported exactly this: "CPU KV cache size: 524,288 tokens" (BENCHMARKS.md).
    plan = plan_stack(load_stack("local"))
    assert plan.ok
    assert plan.models[0].kv_bytes_per_token == 2048
    assert plan.models[0].kv_tokens_per_replica == 524_288


def test_draft_model_shares_the_kv_cache():
    plan = plan_stack(load_stack(PROJECT_ROOT / "tests" / "stacks" / "Pulumi.draft.yaml"))
    # 2,048 + 1,024 (one draft layer) bytes per token; vLLM reported 349,440 tokens for this.
    assert plan.models[0].kv_tokens_per_replica == 349_440


def test_example_stacks_pass_their_plans(example_stack):
    plan = plan_stack(example_stack)
    assert plan.ok, plan.problems
