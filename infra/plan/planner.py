"""Capacity planner: will each model fit on the GPUs it is given, and what does it cost?

Pure functions of a `StackSpec`, the GPU catalog and model shapes. A config that cannot
work (tensor parallelism that does not divide the heads, weights larger than the GPUs,
no room for even one `max_model_len` sequence, a node group too small for `max_replicas`)
comes back with named problems, so `llmctl plan` can refuse it before `pulumi up`.

On GPU node groups the memory left for the KV cache is predicted term by term as the vLLM
release in the cluster image computes it (`infra.plan.vllm_memory`; the release is a parameter, so
published runs of other releases can be checked too). The KV-cache bytes per token are exact
(layers x KV heads x head dim x 2 x dtype bytes). On CPU node groups vLLM's KV cache is a fixed
size (`VLLM_CPU_KVCACHE_SPACE`), so there the token count is exact. BENCHMARKS.md compares
both with what vLLM reports.
"""

from __future__ import annotations

import math
from enum import Enum

from pydantic import BaseModel, Field

from infra.catalog.gpu_catalog import InstanceType, gpu_class_info
from infra.catalog.versions import CLUSTER_VLLM_VERSION
from infra.plan.cold_start import cold_start_timeout_s, expected_cold_start
from infra.plan.ingress_plan import IngressPlan, plan_ingress
from infra.plan.lora_adapters import UnreadableAdapter, adapter_problems, read_local_adapter
from infra.plan.lora_memory import LoraMemory, lora_memory
from infra.plan.model_arch import UnknownModelError, architecture_for, architecture_of_source
from infra.plan.vllm_memory import DEFAULT_BLOCK_SIZE, RankMemory, engine_release, kv_tokens, rank_memory
from infra.spec.schema import (
    Architecture,
    CpuNodeGroup,
    DraftModelSpeculation,
    Dtype,
    GpuNodeGroup,
    ModelSpec,
    Quantization,
    StackSpec,
)

GIB = 1024**3
DTYPE_BYTES = {Dtype.FLOAT32: 4, Dtype.FLOAT16: 2, Dtype.BFLOAT16: 2}
CPU_BLOCK_SIZE = 128  # vLLM's default KV block on CPU (GPU: infra.plan.vllm_memory.DEFAULT_BLOCK_SIZE)
# Ray Serve LLM's OpenAI ingress replica holds one logical CPU (Serve's default). On a cloud
# stack it takes a worker pod's spare CPUs, not a GPU; on the local stack it competes with the
# model replicas for the machine's logical CPUs, so it counts there.
INGRESS_CPUS = 1


class Reason(str, Enum):
    """Why a plan is refused. Stable names: tests and scripts match on them."""

    UNKNOWN_ARCHITECTURE = "unknown_architecture"
    TP_DOES_NOT_DIVIDE_HEADS = "tp_does_not_divide_heads"
    PP_EXCEEDS_LAYERS = "pp_exceeds_layers"
    REPLICA_EXCEEDS_NODE = "replica_exceeds_node"
    WEIGHTS_DO_NOT_FIT = "weights_do_not_fit"
    NO_ROOM_FOR_ONE_SEQUENCE = "no_room_for_one_sequence"
    NODE_GROUP_TOO_SMALL = "node_group_too_small"
    BAD_LORA_ADAPTER = "bad_lora_adapter"
    COLD_START_TIMEOUT_TOO_SHORT = "cold_start_timeout_too_short"


class Problem(BaseModel):
    reason: Reason = Field(description="Machine-readable cause.")
    subject: str = Field(description="The model or node group it concerns.")
    message: str = Field(description="What is wrong and how to fix it.")


class ModelPlan(BaseModel):
    model_id: str
    node_group: str
    instance_type: str | None
    gpus_per_replica: int = Field(description="tensor_parallel_size x pipeline_parallel_size (0 on CPU).")
    weight_bytes: int = Field(description="All weights of one replica.")
    kv_bytes_per_token: int = Field(description="KV cache per token, whole replica.")
    kv_bytes_per_token_per_gpu: int = Field(description="KV cache per token on one rank.")
    kv_cache_bytes_per_rank: int = Field(description="Memory left for KV cache on each rank.")
    kv_tokens_per_replica: int = Field(description="Tokens the KV cache holds (whole blocks).")
    max_concurrent_sequences: int = Field(description="Full max_model_len sequences that fit at once.")
    slots_per_replica: int = Field(description="GPUs (CPU groups: logical CPUs) one replica takes.")
    min_replicas: int
    max_replicas: int
    replicas_per_node: int = Field(description="Replicas one node holds (0 when a replica spans nodes).")
    nodes_per_replica: int = Field(description="Nodes one replica spans (1 unless pipeline stages span).")
    nodes_at_min: int
    nodes_at_max: int
    usd_per_hour_at_min: float | None
    usd_per_hour_at_max: float | None
    gpu_memory: RankMemory | None = Field(
        default=None, description="How vLLM splits one rank's GPU memory (None on CPU)."
    )
    lora: LoraMemory | None = Field(default=None, description="LoRA slots and host cache (models with `lora:`).")
    cold_start_s: float | None = Field(
        default=None, description="Expected start from zero replicas (infra.plan.cold_start)."
    )
    cold_start_timeout_s: float | None = Field(
        default=None, description="How long the gateway holds requests while the model has no replica."
    )


class NodeGroupPlan(BaseModel):
    name: str
    instance_type: str | None
    capacity_type: str
    max_size: int
    nodes_at_min: int = Field(description="Nodes the group's models need at their min replicas.")
    nodes_at_max: int = Field(description="Nodes at max replicas.")
    blue_green: str = Field(description="Whether a NewCluster upgrade (a second cluster) fits.")
    usd_per_hour_at_min: float | None
    usd_per_hour_at_max: float | None


class StackPlan(BaseModel):
    stack: str
    vllm_version: str = Field(description="The vLLM release whose GPU memory accounting the plan models.")
    models: list[ModelPlan]
    node_groups: list[NodeGroupPlan]
    problems: list[Problem]
    ingress: IngressPlan | None = Field(default=None, description="Serving ingress sizing (infra.plan.ingress_plan).")

    @property
    def ok(self) -> bool:
        return not self.problems


# --- sizes -------------------------------------------------------------------------------


def compute_dtype(model: ModelSpec, arch: Architecture, *, on_cpu: bool) -> Dtype:
    """The dtype vLLM computes in: `auto` means bfloat16 for bfloat16 checkpoints and float16
    for float16/float32 ones on GPU; on CPU we always run float32 (see spec's CPU check)."""
    if model.dtype is not Dtype.AUTO:
        return model.dtype
    if on_cpu:
        return Dtype.FLOAT32
    return Dtype.BFLOAT16 if arch.torch_dtype is Dtype.BFLOAT16 else Dtype.FLOAT16


def weight_bytes(arch: Architecture, dtype: Dtype, quantization: Quantization | None) -> int:
    """Weights of one replica. Quantized checkpoints keep embeddings in 16 bits."""
    if quantization is None:
        return arch.parameters * DTYPE_BYTES[dtype]
    embeddings = 2 * arch.vocab_size * arch.hidden_size
    linear = arch.parameters - embeddings
    # 4-bit AWQ/GPTQ: half a byte per weight plus one fp16 scale and a packed zero per 128.
    per_weight = 1.0 if quantization is Quantization.FP8 else 0.5 + 2.5 / 128
    return int(linear * per_weight) + embeddings * 2


def kv_bytes_per_token(arch: Architecture, kv_dtype_bytes: int, *, tp: int = 1, pp: int = 1) -> int:
    """KV cache per token on one rank: layers x KV heads x head dim x (K and V) x bytes.

    Ranks split the KV heads; when there are fewer KV heads than ranks vLLM replicates them,
    so each rank still holds one. Pipeline stages split the layers (the largest stage counts).
    """
    kv_heads_per_rank = max(1, arch.num_key_value_heads // tp)
    layers_per_stage = math.ceil(arch.num_hidden_layers / pp)
    return layers_per_stage * kv_heads_per_rank * arch.head_dim * 2 * kv_dtype_bytes


def _draft_kv(model: ModelSpec, kv_dtype_bytes: int) -> int:
    """A draft model keeps its own KV cache in the same memory, token for token."""
    spec = model.speculative_decoding
    if not isinstance(spec, DraftModelSpeculation):
        return 0
    draft = architecture_of_source(spec.model, subject=f"model {model.id!r} draft")
    return kv_bytes_per_token(draft, kv_dtype_bytes, tp=model.tensor_parallel_size)


# --- planning ----------------------------------------------------------------------------


def plan_stack(spec: StackSpec, *, vllm_version: str = CLUSTER_VLLM_VERSION) -> StackPlan:
    """Plan every model and node group. `vllm_version`: the release whose GPU memory accounting
    to model (the cluster image's by default)."""
    problems: list[Problem] = []
    model_plans = []
    for model in spec.models:
        plan, found = plan_model(model, spec.node_group(model.node_group), vllm_version=vllm_version)
        problems += found + local_adapter_problems(spec, model)
        if plan is not None:
            model_plans.append(plan)
    group_plans = []
    first_cpu_group = next((g.name for g in spec.node_groups if isinstance(g, CpuNodeGroup)), None)
    for group in spec.node_groups:
        reserved = INGRESS_CPUS if spec.cloud.provider == "local" and group.name == first_cpu_group else 0
        group_plan, found = plan_node_group(
            group, [p for p in model_plans if p.node_group == group.name], reserved_slots=reserved
        )
        if spec.cloud.provider == "local":
            group_plan = group_plan.model_copy(update={"blue_green": "n/a (local stack)"})
        group_plans.append(group_plan)
        problems += found
    model_plans, found = _with_cold_starts(spec, model_plans, group_plans)
    ingress = plan_ingress(model_plans, group_plans, local=spec.cloud.provider == "local")
    return StackPlan(
        stack=spec.name,
        vllm_version=vllm_version,
        models=model_plans,
        node_groups=group_plans,
        problems=problems + found,
        ingress=ingress,
    )


def _with_cold_starts(
    spec: StackSpec, models: list[ModelPlan], groups: list[NodeGroupPlan]
) -> tuple[list[ModelPlan], list[Problem]]:
    """Each model's expected cold start; a model that scales to zero may not time out before it."""
    spare = {g.name for g in groups if spec.node_group(g.name).min_size > g.nodes_at_min}
    planned, problems = [], []
    for plan in models:
        model = spec.model(plan.model_id)
        expected = expected_cold_start(
            model, spec.node_group(plan.node_group), weight_bytes=plan.weight_bytes, spare_node=plan.node_group in spare
        )
        timeout = cold_start_timeout_s(model, expected)
        planned.append(
            plan.model_copy(update={"cold_start_s": round(expected.total_s), "cold_start_timeout_s": timeout})
        )
        if model.autoscaling.min_replicas == 0 and timeout < expected.total_s:
            problems.append(
                Problem(
                    reason=Reason.COLD_START_TIMEOUT_TOO_SHORT,
                    subject=model.id,
                    message=f"autoscaling.cold_start_timeout_s {timeout:.0f} s (Pulumi.{spec.name}.yaml, model "
                    f"{model.id!r}) is shorter than its expected cold start of {expected.total_s:.0f} s "
                    f"({expected.breakdown()}): requests would time out while the replica starts; raise it "
                    f"to at least {math.ceil(expected.total_s)}, remove it (default: the estimate with a "
                    "margin), or keep min_replicas >= 1",
                )
            )
    return planned, problems


def local_adapter_problems(spec: StackSpec, model: ModelSpec) -> list[Problem]:
    """Each adapter of `model` in a local folder, checked against the model (infra.plan.lora_adapters);
    adapters already in S3 are checked by `llmctl doctor`, which reads the bucket."""
    if model.lora is None:
        return []
    try:
        arch = architecture_for(model)
    except UnknownModelError:
        return []  # plan_model says so
    found = []
    for adapter in model.lora.adapters:
        if adapter.source.startswith("s3://"):
            continue
        try:
            messages = adapter_problems(model, arch, adapter, read_local_adapter(adapter.source))
        except UnreadableAdapter as exc:
            messages = [str(exc)]
        found += [adapter_problem(spec, model, adapter.id, message) for message in messages]
    return found


def adapter_problem(spec: StackSpec, model: ModelSpec, adapter_id: str, message: str) -> Problem:
    """A refused adapter, named as the stack file names it."""
    return Problem(
        reason=Reason.BAD_LORA_ADAPTER,
        subject=f"{model.id}:{adapter_id}",
        message=f"Pulumi.{spec.name}.yaml, model {model.id!r}, lora adapter {adapter_id!r}: {message}",
    )


def plan_model(
    model: ModelSpec, group: GpuNodeGroup | CpuNodeGroup, *, vllm_version: str = CLUSTER_VLLM_VERSION
) -> tuple[ModelPlan | None, list[Problem]]:
    try:
        arch = architecture_for(model)
        problems = _parallelism_problems(model, arch)
        if problems:
            return None, problems
        if isinstance(group, CpuNodeGroup):
            return _plan_on_cpu(model, group, arch)
        return _plan_on_gpu(model, group, arch, vllm_version)
    except UnknownModelError as exc:
        return None, [Problem(reason=Reason.UNKNOWN_ARCHITECTURE, subject=model.id, message=str(exc))]


def _parallelism_problems(model: ModelSpec, arch: Architecture) -> list[Problem]:
    tp, pp = model.tensor_parallel_size, model.pipeline_parallel_size
    found = []
    kv = arch.num_key_value_heads
    if arch.num_attention_heads % tp or (kv % tp and tp % kv):
        found.append(
            Problem(
                reason=Reason.TP_DOES_NOT_DIVIDE_HEADS,
                subject=model.id,
                message=f"tensor_parallel_size {tp} must divide the {arch.num_attention_heads} attention heads, "
                f"and divide or be a multiple of the {kv} KV heads; valid sizes: "
                f"{_valid_tp_sizes(arch)}",
            )
        )
    if pp > arch.num_hidden_layers:
        found.append(
            Problem(
                reason=Reason.PP_EXCEEDS_LAYERS,
                subject=model.id,
                message=f"pipeline_parallel_size {pp} exceeds the {arch.num_hidden_layers} layers",
            )
        )
    return found


def _valid_tp_sizes(arch: Architecture) -> list[int]:
    kv = arch.num_key_value_heads
    return [t for t in range(1, 65) if arch.num_attention_heads % t == 0 and (kv % t == 0 or t % kv == 0)]


def _plan_on_gpu(
    model: ModelSpec, group: GpuNodeGroup, arch: Architecture, vllm_version: str
) -> tuple[ModelPlan | None, list[Problem]]:
    instance = group.instance
    tp, pp, gpus = model.tensor_parallel_size, model.pipeline_parallel_size, model.gpus_per_replica
    if gpus > instance.gpus and (pp == 1 or tp > instance.gpus):
        hint = (
            f"lower tensor_parallel_size, or keep it <= {instance.gpus} and add pipeline_parallel_size to span nodes"
            if tp > instance.gpus
            else ""
        )
        return None, [
            Problem(
                reason=Reason.REPLICA_EXCEEDS_NODE,
                subject=model.id,
                message=f"a replica needs {gpus} GPUs but {instance.instance_type} has {instance.gpus}; "
                f"{hint or 'use pipeline_parallel_size to span nodes or a larger instance type'}",
            )
        ]
    dtype = compute_dtype(model, arch, on_cpu=False)
    weights = weight_bytes(arch, dtype, model.quantization)
    kv_dtype_bytes = 1 if model.kv_cache_dtype == "fp8" else DTYPE_BYTES[dtype]
    per_gpu_token = kv_bytes_per_token(arch, kv_dtype_bytes, tp=tp, pp=pp) + _draft_kv(model, kv_dtype_bytes)
    lora = lora_memory(arch, model.lora, dtype_bytes=DTYPE_BYTES[dtype], tp=tp) if model.lora else None
    memory = rank_memory(
        engine_release(vllm_version),
        gpu_class_info(instance.gpu_class),
        arch,
        weights_per_rank=math.ceil(weights / gpus),
        dtype_bytes=DTYPE_BYTES[dtype],
        tp=tp,
        gpus=gpus,
        gpu_memory_utilization=model.gpu_memory_utilization,
        engine_args=model.engine_args,
        lora_slots=lora.slots_per_rank if lora else 0,
    )
    block_size = int(model.engine_args.get("block_size", DEFAULT_BLOCK_SIZE))
    tokens = kv_tokens(memory.kv_cache, per_gpu_token, block_size)
    problems = []
    if memory.kv_cache <= 0:
        problems.append(
            Problem(
                reason=Reason.WEIGHTS_DO_NOT_FIT,
                subject=model.id,
                message=f"each GPU would need {_gib(memory.weights)} of weights + "
                f"{_gib(memory.requested - memory.weights - memory.kv_cache)} runtime (vLLM {vllm_version}), "
                f"but gets {_gib(memory.requested)} ({model.gpu_memory_utilization:.0%} of "
                f"{instance.gpu_class.value}); raise tensor_parallel_size, quantize, or use a larger GPU class",
            )
        )
    elif tokens < math.ceil(model.max_model_len / block_size) * block_size:
        problems.append(_no_room(model, tokens))
    plan = _finish(
        model, group, instance, gpus, weights, arch, kv_dtype_bytes, per_gpu_token, max(0, memory.kv_cache), tokens
    )
    return plan.model_copy(update={"gpu_memory": memory, "lora": lora}), problems


def _plan_on_cpu(model: ModelSpec, group: CpuNodeGroup, arch: Architecture) -> tuple[ModelPlan, list[Problem]]:
    dtype = compute_dtype(model, arch, on_cpu=True)
    per_token = kv_bytes_per_token(
        arch, DTYPE_BYTES[dtype], tp=model.tensor_parallel_size, pp=model.pipeline_parallel_size
    ) + _draft_kv(model, DTYPE_BYTES[dtype])
    kv_space = int(model.cpu_kv_cache_gib * GIB)
    tokens = _whole_blocks(kv_space // per_token, int(model.engine_args.get("block_size", CPU_BLOCK_SIZE)))
    plan = _finish(
        model,
        group,
        None,
        0,
        weight_bytes(arch, dtype, model.quantization),
        arch,
        DTYPE_BYTES[dtype],
        per_token,
        kv_space,
        tokens,
    )
    if model.lora is not None:  # in RAM beside the weights; the KV cache keeps its fixed size
        plan = plan.model_copy(update={"lora": lora_memory(arch, model.lora, dtype_bytes=DTYPE_BYTES[dtype])})
    return plan, [_no_room(model, tokens)] if tokens < model.max_model_len else []


def _finish(
    model: ModelSpec,
    group: GpuNodeGroup | CpuNodeGroup,
    instance: InstanceType | None,
    gpus: int,
    weights: int,
    arch: Architecture,
    kv_dtype_bytes: int,
    per_gpu_token: int,
    kv_space: int,
    tokens: int,
) -> ModelPlan:
    if instance is not None:
        slots = gpus
        nodes_per_replica = (
            1
            if gpus <= instance.gpus
            else math.ceil(model.pipeline_parallel_size / (instance.gpus // model.tensor_parallel_size))
        )
        per_node = instance.gpus // gpus if gpus <= instance.gpus else 0
    else:
        assert isinstance(group, CpuNodeGroup)
        # Each CPU replica holds one logical CPU for its actor and one per engine rank.
        slots = 1 + model.tensor_parallel_size * model.pipeline_parallel_size
        nodes_per_replica, per_node = 1, max(1, group.cpus_per_node // slots)

    def nodes(replicas: int) -> int:
        return replicas * nodes_per_replica if per_node == 0 else math.ceil(replicas / per_node)

    def cost(n: int) -> float | None:
        return None if instance is None else round(n * instance.on_demand_usd_per_hour, 2)

    lo, hi = nodes(model.autoscaling.min_replicas), nodes(model.autoscaling.max_replicas)
    return ModelPlan(
        model_id=model.id,
        node_group=group.name,
        instance_type=getattr(instance, "instance_type", None),
        gpus_per_replica=gpus,
        slots_per_replica=slots,
        min_replicas=model.autoscaling.min_replicas,
        max_replicas=model.autoscaling.max_replicas,
        weight_bytes=weights,
        kv_bytes_per_token=kv_bytes_per_token(arch, kv_dtype_bytes),
        kv_bytes_per_token_per_gpu=per_gpu_token,
        kv_cache_bytes_per_rank=kv_space,
        kv_tokens_per_replica=tokens,
        max_concurrent_sequences=tokens // model.max_model_len,
        replicas_per_node=per_node,
        nodes_per_replica=nodes_per_replica,
        nodes_at_min=lo,
        nodes_at_max=hi,
        usd_per_hour_at_min=cost(lo),
        usd_per_hour_at_max=cost(hi),
    )


def plan_node_group(
    group: GpuNodeGroup | CpuNodeGroup, models: list[ModelPlan], *, reserved_slots: int = 0
) -> tuple[NodeGroupPlan, list[Problem]]:
    """Nodes a group needs for its models (plus `reserved_slots` taken by other actors, e.g.
    the ingress on the local stack), and whether its max_size holds them.

    Models share nodes: a worker pod offers all of its node's GPUs (or CPUs) and Ray places
    replicas of any model into them. When every replica's size divides the node's capacity
    (the usual powers of two), replicas pack without waste and the count is exact; otherwise
    each model gets whole nodes of its own, which over-counts rather than under-counts.
    """
    capacity = _node_capacity(group)
    packable = all(m.nodes_per_replica == 1 and capacity % m.slots_per_replica == 0 for m in models)

    def nodes(at_max: bool) -> int:
        if packable:
            slots = reserved_slots + sum(
                m.slots_per_replica * (m.max_replicas if at_max else m.min_replicas) for m in models
            )
            return math.ceil(slots / capacity)
        return sum(m.nodes_at_max if at_max else m.nodes_at_min for m in models)

    lo, hi = nodes(False), nodes(True)
    problems = []
    if hi > group.max_size:
        needs = ", ".join(
            [f"{m.model_id}: {m.max_replicas} x {m.slots_per_replica}" for m in models]
            + ([f"OpenAI ingress: {reserved_slots}"] if reserved_slots else [])
        )
        unit = "GPUs" if isinstance(group, GpuNodeGroup) else "CPUs"
        alternative = "" if isinstance(group, GpuNodeGroup) else " (or its cpus_per_node)"
        problems.append(
            Problem(
                reason=Reason.NODE_GROUP_TOO_SMALL,
                subject=group.name,
                message=f"max_replicas need {hi} nodes of {capacity} {unit} ({needs}) but max_size is "
                f"{group.max_size}; raise max_size of node group {group.name!r} to {hi}{alternative} "
                "or lower max_replicas",
            )
        )
    # A NewCluster upgrade starts a whole second cluster at min replicas beside the old one.
    if hi + lo <= group.max_size:
        blue_green = "fits"
    elif 2 * lo <= group.max_size:
        blue_green = "fits only below peak load"
    else:
        blue_green = f"does not fit (needs {2 * lo} nodes at min load)"
    price = group.instance.on_demand_usd_per_hour if isinstance(group, GpuNodeGroup) else None
    return NodeGroupPlan(
        name=group.name,
        instance_type=getattr(group, "instance_type", None),
        capacity_type=group.capacity_type.value,
        max_size=group.max_size,
        nodes_at_min=lo,
        nodes_at_max=hi,
        blue_green=blue_green,
        usd_per_hour_at_min=None if price is None else round(lo * price, 2),
        usd_per_hour_at_max=None if price is None else round(hi * price, 2),
    ), problems


def _node_capacity(group: GpuNodeGroup | CpuNodeGroup) -> int:
    return group.instance.gpus if isinstance(group, GpuNodeGroup) else group.cpus_per_node


def _whole_blocks(tokens: int, block_size: int) -> int:
    return max(0, tokens) // block_size * block_size


def _no_room(model: ModelSpec, tokens: int) -> Problem:
    return Problem(
        reason=Reason.NO_ROOM_FOR_ONE_SEQUENCE,
        subject=model.id,
        message=f"the KV cache holds {tokens} tokens, less than one max_model_len ({model.max_model_len}) "
        "sequence; lower max_model_len, raise gpu_memory_utilization or tensor_parallel_size, "
        "or use kv_cache_dtype: fp8",
    )


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"
