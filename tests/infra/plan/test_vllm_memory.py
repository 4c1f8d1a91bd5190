"""vLLM's per-release memory terms: which exist for a release, and the defaults they depend on."""

from __future__ import annotations

import pytest

from infra.catalog.gpu_catalog import GpuClass, gpu_class_info
from infra.plan.model_arch import BUILTIN
from infra.plan.vllm_memory import (
    ModelRunner,
    batch_limits,
    engine_release,
    kv_tokens,
    parse_version,
    rank_memory,
)

LLAMA_8B = BUILTIN["meta-llama/Llama-3.1-8B-Instruct"]
GIB = 1024**3


def memory(version: str, gpu: GpuClass = GpuClass.H100_80GB, **engine_args):
    return rank_memory(
        engine_release(version),
        gpu_class_info(gpu),
        LLAMA_8B,
        weights_per_rank=2 * LLAMA_8B.parameters,
        dtype_bytes=2,
        tp=1,
        gpus=1,
        gpu_memory_utilization=0.9,
        engine_args=engine_args,
    )


def test_versions_parse_with_suffixes():
    assert parse_version("0.29.0") == (0, 29, 0)
    assert parse_version("0.25.1+cu130") == (0, 25, 1)
    assert parse_version("0.11.0rc2") == (0, 11, 0)


@pytest.mark.parametrize(
    ("version", "v1", "runner", "graphs"),
    [
        ("0.7.3", False, ModelRunner.V1, False),
        ("0.11.0", True, ModelRunner.V1, False),
        ("0.21.0", True, ModelRunner.V1, True),
        ("0.25.0", True, ModelRunner.V1, True),
        ("0.25.1", True, ModelRunner.V2, True),
        ("0.29.0", True, ModelRunner.V2, True),
    ],
)
def test_release_behaviour(version, v1, runner, graphs):
    release = engine_release(version)
    assert (release.v1_engine, release.model_runner, release.subtracts_cudagraphs) == (v1, runner, graphs)


@pytest.mark.parametrize(
    ("gpu", "tokens", "seqs"),
    [
        (GpuClass.H100_80GB, 8192, 1024),
        (GpuClass.A100_80GB, 2048, 256),  # 80 GB, but vLLM keeps the small defaults for anything named A100
        (GpuClass.L40S, 2048, 256),
        (GpuClass.L4, 2048, 256),
    ],
)
def test_openai_server_batch_defaults_follow_the_gpu(gpu, tokens, seqs):
    limits = batch_limits(gpu_class_info(gpu), {})
    assert (limits.max_num_batched_tokens, limits.max_num_seqs) == (tokens, seqs)


def test_engine_args_override_batch_defaults_and_shrink_the_profiling_peak():
    default, small = memory("0.29.0"), memory("0.29.0", max_num_batched_tokens=1024, max_num_seqs=64)
    assert (small.max_num_batched_tokens, small.max_num_seqs) == (1024, 64)
    assert small.activation_peak < default.activation_peak
    assert small.cuda_graphs < default.cuda_graphs
    assert small.kv_cache > default.kv_cache


def test_cuda_graphs_are_charged_only_from_0_21_and_never_when_eager():
    assert memory("0.20.2").cuda_graphs == 0
    assert memory("0.21.0").cuda_graphs > 0
    assert memory("0.29.0", enforce_eager=True).cuda_graphs == 0


def test_model_runner_v1_peaks_in_the_sampler():
    # Its dummy sampler run sorts float32 logits for top-k/top-p over max_num_seqs rows: on an
    # H100 (1,024 rows) the peak is several GiB, against under 1 GiB for runner V2's forward pass.
    assert memory("0.11.0").activation_peak > 4 * GIB
    assert memory("0.29.0").activation_peak < 1 * GIB


def test_explicit_kv_cache_memory_bytes_wins():
    assert memory("0.29.0", kv_cache_memory_bytes=10 * GIB).kv_cache == 10 * GIB


def test_kv_tokens_are_whole_blocks_and_none_when_nothing_is_left():
    per_token = 128 * 1024
    assert kv_tokens(per_token * 16 * 3 + per_token * 15, per_token, 16) == 48
    assert kv_tokens(0, per_token, 16) == 0
    assert kv_tokens(-GIB, per_token, 16) == 0
