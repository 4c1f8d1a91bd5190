"""How long a model takes to serve its first request from zero replicas, step by step (pure).

A model with `autoscaling.min_replicas: 0` keeps its requests waiting in the gateway's queue
while Ray Serve starts a replica. On AWS that replica may need a new GPU node; every step:

    scheduling    Ray's autoscaler asks for a worker pod, the Cluster Autoscaler for a node
    node boot     EC2 launches the GPU instance, it joins EKS, the NVIDIA device plugin reports GPUs
    image pull    the serving image (ray-llm: CUDA, PyTorch, vLLM) onto the new node
    weights       from the stack's S3 model cache (or the Hugging Face hub) onto the node's disk
    engine start  the replica's processes, weights into GPU memory, vLLM's profiling, torch.compile
                  and CUDA graph capture

Each figure below is a planning estimate with its source; the real figure depends on the
instance, the image and the model. Calibrate with the events of a real cold start: `kubectl
get events` shows the image pull time ("Successfully pulled image ... in 3m2s"), and the
replica's log shows vLLM's "init engine ... took N seconds". `llmctl plan` prints the estimate
per model and refuses a `cold_start_timeout_s` shorter than it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from infra.spec.schema import CpuNodeGroup, GpuNodeGroup, ModelSpec

MIB = 1024**2
GIB = 1024**3

# Ray's autoscaler runs every 5 s (ray/autoscaler/_private/constants.py AUTOSCALER_UPDATE_INTERVAL_S,
# Ray 2.60) and the Cluster Autoscaler scans every 10 s (its `--scan-interval` flag's default,
# kubernetes/autoscaler cluster-autoscaler). Ray Serve itself scales up from zero on the first
# request, without upscale_delay_s (ray/serve/autoscaling_policy.py, Ray 2.60).
SCHEDULING_S = 15.0
# "cloud providers take 80-120 seconds to provision and boot new GPU instances" (Tensorfuse,
# "Lazy loading performance degradation", 2025-08-24, tensorfuse.io/docs/blogs): the top of that range.
NODE_BOOT_S = 120.0
# "Standard Docker image pulls of 15-20 GB can take 4-6 minutes per instance" (AWS Machine
# Learning Blog, "Reducing container cold start times using SOCI index on DLAMI and DLC"). The
# ray-llm image carries the same stack (CUDA, PyTorch, vLLM); the top of the range.
IMAGE_PULL_S = 360.0
# Weights land on the node's root volume: gp3, whose throughput defaults to 125 MiB/s (EC2
# CreateVolume `Throughput`: "gp3 ... default 125"); infra/aws/launch_template.py sets none.
# Ray Serve LLM downloads a cache folder with up to 100 parallel boto3 GETs
# (ray/llm/_internal/common/utils/cloud_filesystem/s3_filesystem.py, Ray 2.60), so the disk,
# not S3 or the instance's network, is the limit.
DISK_WRITE_BYTES_PER_S = 125 * MIB
# Weights still in the page cache load into GPU memory fast: vLLM logged "Model loading took
# 3.4213 GiB and 0.902026 seconds" (vllm-project/vllm#20264); half that rate, for margin. Weights
# larger than half the node's memory are read back from the disk instead.
PAGE_CACHE_LOAD_BYTES_PER_S = 2 * GIB
# vLLM's engine init with torch.compile for an 8B model on an L4: "init engine (profile, create
# kv cache, warmup model) took 87.17 seconds" (vllm-project/vllm#11078, its torch.compile guide);
# plus the process and import time that log does not show: a pod answered 59 s after start
# with a 34 s engine init, "a loss of ~30s, which isn't logged" (vllm-project/vllm#20264).
ENGINE_INIT_S = 90.0
PROCESS_START_S = 30.0
# A local (`make dev`) CPU replica: Ray start plus a CPU vLLM engine on the tiny model reached
# `running` at about 62 s, and one replica deployed in 44-55 s (BENCHMARKS.md, "Cold start of
# `make dev`" and the autoscaling demo); the measured top, rounded up.
LOCAL_ENGINE_START_S = 90.0
# A timeout left to its default is the estimate with this margin, rounded up to a minute.
DEFAULT_TIMEOUT_MARGIN = 1.5


class ColdStart(BaseModel):
    """Expected seconds per step of one model's start from zero replicas."""

    scheduling_s: float = Field(description="Ray's autoscaler and the Cluster Autoscaler reacting.")
    node_boot_s: float = Field(description="A new GPU node (0 when the node group keeps a spare one).")
    image_pull_s: float = Field(description="The serving image onto the node.")
    weights_s: float = Field(description="Weights onto the node's disk.")
    engine_start_s: float = Field(description="Replica processes, weights into memory, vLLM init.")
    weights_from: str = Field(description="s3 cache, hub (its speed not bounded here: at least this), or local.")

    @property
    def total_s(self) -> float:
        return self.scheduling_s + self.node_boot_s + self.image_pull_s + self.weights_s + self.engine_start_s

    def breakdown(self) -> str:
        return (
            f"scheduling {self.scheduling_s:.0f} s + node boot {self.node_boot_s:.0f} s + image pull "
            f"{self.image_pull_s:.0f} s + weights ({self.weights_from}) {self.weights_s:.0f} s + engine start "
            f"{self.engine_start_s:.0f} s"
        )


def expected_cold_start(
    model: ModelSpec, group: GpuNodeGroup | CpuNodeGroup, *, weight_bytes: int, spare_node: bool
) -> ColdStart:
    """The estimate for `model` on `group`. `weight_bytes`: one replica's weights (the planner's);
    `spare_node`: the group keeps a running node with room for the replica (no node boot)."""
    if isinstance(group, CpuNodeGroup):
        return ColdStart(
            scheduling_s=0,
            node_boot_s=0,
            image_pull_s=0,
            weights_s=0,
            engine_start_s=LOCAL_ENGINE_START_S,
            weights_from="local",
        )
    host_bytes = group.instance.memory_gib * GIB
    per_gpu = weight_bytes / model.gpus_per_replica
    load_rate = PAGE_CACHE_LOAD_BYTES_PER_S if weight_bytes <= host_bytes / 2 else DISK_WRITE_BYTES_PER_S
    return ColdStart(
        scheduling_s=SCHEDULING_S,
        node_boot_s=0 if spare_node else NODE_BOOT_S,
        image_pull_s=IMAGE_PULL_S,
        weights_s=weight_bytes / DISK_WRITE_BYTES_PER_S,
        engine_start_s=PROCESS_START_S + ENGINE_INIT_S + per_gpu / load_rate,
        weights_from="s3 cache" if model.cached else "hub",
    )


def default_timeout_s(expected: ColdStart) -> float:
    """The cold-start timeout of a model whose stack entry sets none."""
    return 60.0 * math.ceil(expected.total_s * DEFAULT_TIMEOUT_MARGIN / 60)


def cold_start_timeout_s(model: ModelSpec, expected: ColdStart) -> float:
    """How long the gateway holds requests for this model while it has no replica."""
    explicit = model.autoscaling.cold_start_timeout_s
    return explicit if explicit is not None else default_timeout_s(expected)
