"""The stack spec: everything a user states about one environment, as typed models.

A stack file (`Pulumi.<stack>.yaml`) holds these under `config:` as `llmstack:<key>`
entries. `infra.stack_file.load_stack` reads and validates them once; every consumer
(`llmctl plan`, `llmctl render`, the Pulumi program, `make dev`) takes a `StackSpec` and
never reads the YAML itself, so they cannot disagree.

Validators here check what one model can check about itself. Checks that need the GPU
catalog or model architecture (does it fit?) live in `infra.planner`.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infra import versions
from infra.gpu_catalog import GpuClass, default_instance_for, load_catalog

# The gateway validates these same limits at start; one model keeps the two in step.
from serving.gateway.settings import KeyLimits

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"


class _Spec(BaseModel):
    """Strict base: unknown keys are typos, and typos in infrastructure config are bugs."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# --- cloud -------------------------------------------------------------------------------


class AwsCloud(_Spec):
    provider: Literal["aws"] = Field(description="Provision on AWS (EKS).")
    region: str = Field(description="AWS region, e.g. us-east-1. Defaults to `aws:region`.")
    availability_zones: list[str] = Field(
        min_length=2,
        description="Zones for subnets and node groups; EKS needs at least two.",
    )
    kubernetes_version: str = Field(
        default=versions.KUBERNETES_VERSION, pattern=r"^1\.\d+$", description="EKS version, e.g. 1.33."
    )

    @model_validator(mode="after")
    def _zones_in_region(self) -> AwsCloud:
        wrong = [z for z in self.availability_zones if not z.startswith(self.region)]
        if wrong:
            raise ValueError(
                f"availability zones {wrong} are not in region {self.region}; "
                f"use zones like {self.region}a, {self.region}b"
            )
        return self


class LocalCloud(_Spec):
    provider: Literal["local"] = Field(description="Run on this machine (`make dev`): no cloud.")


Cloud = Annotated[AwsCloud | LocalCloud, Field(discriminator="provider")]


# --- node groups -------------------------------------------------------------------------


class CapacityType(str, Enum):
    ON_DEMAND = "on-demand"
    SPOT = "spot"


class _NodeGroupBase(_Spec):
    name: str = Field(pattern=DNS_LABEL, description="Node group name; a Kubernetes-safe label.")
    min_size: int = Field(default=0, ge=0, description="Fewest nodes the autoscaler keeps.")
    max_size: int = Field(ge=1, description="Most nodes the autoscaler may start.")
    desired_size: int | None = Field(default=None, ge=0, description="Nodes at creation; default min_size.")
    capacity_type: CapacityType = Field(default=CapacityType.ON_DEMAND, description="on-demand or spot.")
    disk_size_gib: int = Field(default=200, ge=20, description="Root volume; must hold images and weights.")

    @model_validator(mode="after")
    def _sizes_ordered(self) -> _NodeGroupBase:
        desired = self.min_size if self.desired_size is None else self.desired_size
        if not self.min_size <= desired <= self.max_size:
            raise ValueError(
                f"need min_size <= desired_size <= max_size, got {self.min_size} <= {desired} <= {self.max_size}"
            )
        return self

    @property
    def desired(self) -> int:
        return self.min_size if self.desired_size is None else self.desired_size


class GpuNodeGroup(_NodeGroupBase):
    kind: Literal["gpu"] = Field(description="A GPU node group.")
    gpu_class: GpuClass | None = Field(default=None, description="GPU class; picks the smallest instance.")
    instance_type: str | None = Field(default=None, description="EC2 instance type from the GPU catalog.")

    @model_validator(mode="after")
    def _resolve_instance(self) -> GpuNodeGroup:
        catalog = load_catalog()
        if self.instance_type is None:
            if self.gpu_class is None:
                raise ValueError("set gpu_class (e.g. L4) or instance_type (e.g. g6.xlarge)")
            object.__setattr__(self, "instance_type", default_instance_for(self.gpu_class).instance_type)
        if self.instance_type not in catalog:
            raise ValueError(
                f"instance_type {self.instance_type!r} is not in the GPU catalog; known: {', '.join(catalog)}"
            )
        actual = catalog[self.instance_type].gpu_class
        if self.gpu_class is not None and self.gpu_class != actual:
            raise ValueError(
                f"instance_type {self.instance_type} has {actual.value} GPUs, not gpu_class {self.gpu_class.value}"
            )
        object.__setattr__(self, "gpu_class", actual)
        return self


class CpuNodeGroup(_NodeGroupBase):
    kind: Literal["cpu"] = Field(description="A CPU-only group: the local machine, or CPU nodes.")
    cpus_per_node: int = Field(default=4, ge=1, description="Logical CPUs each Ray worker offers.")
    memory_gib_per_node: int = Field(default=8, ge=1, description="Memory each Ray worker may use.")


NodeGroup = Annotated[GpuNodeGroup | CpuNodeGroup, Field(discriminator="kind")]


# --- models ------------------------------------------------------------------------------


class Dtype(str, Enum):
    AUTO = "auto"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"


class Quantization(str, Enum):
    AWQ = "awq"
    GPTQ = "gptq"
    FP8 = "fp8"


class NgramSpeculation(_Spec):
    method: Literal["ngram"] = Field(description="Prompt-lookup (n-gram) drafting: no draft model.")
    num_speculative_tokens: int = Field(default=4, ge=1, le=16, description="Tokens proposed per step.")
    prompt_lookup_max: int = Field(default=4, ge=1, description="Longest n-gram matched in the prompt.")
    prompt_lookup_min: int = Field(default=1, ge=1, description="Shortest n-gram matched.")


class DraftModelSpeculation(_Spec):
    method: Literal["draft_model"] = Field(description="A small draft model sharing the tokenizer.")
    model: str = Field(description="Draft model source: hub id or local folder.")
    num_speculative_tokens: int = Field(default=4, ge=1, le=16, description="Tokens proposed per step.")


Speculation = Annotated[NgramSpeculation | DraftModelSpeculation, Field(discriminator="method")]


class Autoscaling(_Spec):
    """Ray Serve autoscaling for one model's replicas (names follow `autoscaling_config`)."""

    min_replicas: int = Field(default=1, ge=0, description="Replicas kept when idle.")
    max_replicas: int = Field(default=1, ge=1, description="Most replicas under load.")
    target_ongoing_requests: float = Field(default=16, gt=0, description="Per-replica load Serve aims for.")
    max_ongoing_requests: int = Field(default=64, ge=1, description="Per-replica cap; beyond it requests queue.")
    upscale_delay_s: float = Field(default=30, ge=0, description="Sustained load before adding replicas.")
    downscale_delay_s: float = Field(default=600, ge=0, description="Sustained idleness before removing.")

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        if self.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"target_ongoing_requests {self.target_ongoing_requests} exceeds max_ongoing_requests "
                f"{self.max_ongoing_requests}: replicas could never reach their target"
            )
        return self


class Routing(str, Enum):
    """How Serve picks a replica for each request of a model (`request_router_config`)."""

    POW2 = "pow2"  # Serve's default: the less busy of two random replicas
    PREFIX = "prefix"  # Ray Serve LLM's PrefixCacheAffinityRouter: same prompt prefix, same replica


class Architecture(_Spec):
    """Explicit model shape, for models neither local nor in the built-in table."""

    num_hidden_layers: int = Field(ge=1, description="Transformer layers.")
    num_attention_heads: int = Field(ge=1, description="Query heads.")
    num_key_value_heads: int = Field(ge=1, description="KV heads (GQA); equal to query heads for MHA.")
    head_dim: int = Field(ge=1, description="Per-head dimension.")
    hidden_size: int = Field(ge=1, description="Model width.")
    intermediate_size: int = Field(ge=1, description="MLP width.")
    vocab_size: int = Field(ge=1, description="Vocabulary size.")
    parameters: int = Field(ge=1, description="Total parameter count (for weight bytes).")
    torch_dtype: Dtype = Field(default=Dtype.BFLOAT16, description="Dtype the checkpoint is stored in.")


# Engine settings llmstack owns: set them with the typed field, not engine_args.
MANAGED_ENGINE_ARGS = frozenset(
    {"model", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len", "gpu_memory_utilization",
     "dtype", "quantization", "kv_cache_dtype", "speculative_config", "served_model_name"}
)


class ModelSpec(_Spec):
    id: str = Field(pattern=DNS_LABEL, description="Our name for the model (`llmctl --model ID`).")
    source: str = Field(description="Hugging Face hub id, or a local folder with config.json.")
    served_name: str | None = Field(default=None, description="Name clients request; default `id`.")
    node_group: str = Field(description="Name of the node group the replicas run on.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs sharding each layer.")
    pipeline_parallel_size: int = Field(default=1, ge=1, description="Stages splitting the layers.")
    max_model_len: int = Field(ge=16, description="Longest prompt + output, in tokens.")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=0.98, description="Fraction of each GPU's memory vLLM may use."
    )
    cpu_kv_cache_gib: int = Field(
        default=1, ge=1, description="KV cache GiB on CPU node groups (vLLM's VLLM_CPU_KVCACHE_SPACE)."
    )
    dtype: Dtype = Field(default=Dtype.AUTO, description="Compute dtype; auto = the checkpoint's.")
    kv_cache_dtype: Literal["auto", "fp8"] = Field(default="auto", description="fp8 halves KV bytes.")
    quantization: Quantization | None = Field(default=None, description="Weight quantization, if any.")
    speculative_decoding: Speculation | None = Field(default=None, description="Optional speculation.")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, description="Replica autoscaling.")
    routing: Routing = Field(
        default=Routing.POW2,
        description="Replica choice per request: pow2 (least busy of two) or prefix (requests sharing a "
                    "prompt prefix go to the replica that has it cached; for multi-turn chat and long shared "
                    "system prompts, with two or more replicas).",
    )
    architecture: Architecture | None = Field(default=None, description="Explicit shape if not known.")
    cached: bool = Field(
        default=False,
        description="Load the weights from the stack's S3 model cache (`llmctl models sync`) instead of "
                    "downloading `source` on every new node. AWS stacks only.",
    )
    engine_args: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine args.")

    @model_validator(mode="after")
    def _no_shadowed_engine_args(self) -> ModelSpec:
        clash = sorted(MANAGED_ENGINE_ARGS & self.engine_args.keys())
        if clash:
            raise ValueError(f"engine_args sets {clash}; set these with the model's own keys instead")
        return self

    @property
    def model_name(self) -> str:
        """The name clients put in `"model": ...`."""
        return self.served_name or self.id

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


# --- redis and gateway -------------------------------------------------------------------


class ManagedRedis(_Spec):
    mode: Literal["managed"] = Field(description="ElastiCache with TLS, AUTH and encryption at rest.")
    node_type: str = Field(default="cache.t4g.small", description="ElastiCache node type.")
    replicas: int = Field(default=1, ge=0, le=5, description="Read replicas (0 = no failover).")


class InClusterRedis(_Spec):
    mode: Literal["in_cluster"] = Field(description="A Redis pod in the cluster: cheap dev stacks only.")
    storage_gib: int = Field(default=8, ge=1, description="Persistent volume size.")


class ExternalRedis(_Spec):
    mode: Literal["external"] = Field(description="A Redis you run; password in a secret config value.")
    host: str = Field(description="Host name reachable from the cluster.")
    port: int = Field(default=6379, ge=1, le=65535, description="Port.")
    tls: bool = Field(default=True, description="Connect with TLS.")


class LocalRedis(_Spec):
    mode: Literal["local"] = Field(
        description="`make dev`: a private redis-server if installed, else the gateway's in-memory store."
    )


Redis = Annotated[ManagedRedis | InClusterRedis | ExternalRedis | LocalRedis, Field(discriminator="mode")]


class Gateway(_Spec):
    min_replicas: int = Field(default=2, ge=1, description="Gateway pods kept (HPA minimum).")
    max_replicas: int = Field(default=6, ge=1, description="HPA maximum.")
    port: int = Field(default=8080, ge=1024, le=65535, description="Port the gateway listens on.")
    default_limits: KeyLimits = Field(default_factory=KeyLimits, description="Per-key defaults.")
    max_tokens_ceiling: int = Field(default=4096, ge=1, description="Largest max_tokens accepted.")
    max_n: int = Field(default=4, ge=1, description="Largest n (and best_of) accepted.")
    max_top_logprobs: int = Field(default=5, ge=0, description="Largest top_logprobs accepted.")
    allow_logit_bias: bool = Field(default=False, description="logit_bias helps extract a model; off by default.")
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="Largest request body.")
    limiter_fail_mode: Literal["local", "closed"] = Field(
        default="local", description="When Redis is down: per-replica limits, or refuse."
    )
    upstream_idle_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest upstream silence (queue wait or between stream chunks).")
    request_timeout_s: float = Field(default=600.0, gt=0, description="Longest whole request, stream included.")
    key_cache_ttl_s: float = Field(
        default=60.0, ge=0, description="During a Redis outage, keys verified this recently still work.")
    log_prompts: bool = Field(default=False, description="Put prompts in access logs (tenants' data: off).")
    certificate_arn: str | None = Field(default=None, description="ACM certificate for TLS on the NLB.")

    @model_validator(mode="after")
    def _ordered(self) -> Gateway:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class Versions(_Spec):
    serving_image: str = Field(
        default=versions.SERVING_IMAGE,
        description=f"Ray cluster image: {versions.RAY_LLM_IMAGE} plus llmstack (serving/images/serving.Dockerfile).",
    )
    gateway_image: str = Field(default=versions.GATEWAY_IMAGE, description="llmstack gateway image.")
    kuberay_operator: str = Field(default=versions.KUBERAY_VERSION, description="KubeRay chart version.")


class ModelCache(_Spec):
    """The stack's S3 model cache. Naming rule and layout: `infra.model_cache`."""

    bucket: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$",
        description="Bucket name; default `llmstack-<stack>-models-<account id>` (unique per account).",
    )


# --- the stack ---------------------------------------------------------------------------


class StackSpec(_Spec):
    """One environment. Cross-references (model -> node group) are checked here."""

    name: str = Field(pattern=DNS_LABEL, description="Stack name, from the file name.")
    cloud: Cloud = Field(description="Where the stack runs.")
    node_groups: list[NodeGroup] = Field(min_length=1, description="Where model replicas run.")
    models: list[ModelSpec] = Field(min_length=1, description="Models served.")
    redis: Redis = Field(description="Redis for keys, limits, usage and Ray GCS fault tolerance.")
    gateway: Gateway = Field(default_factory=Gateway, description="The API gateway.")
    versions: Versions = Field(default_factory=Versions, description="Pinned versions.")
    model_cache: ModelCache = Field(default_factory=ModelCache, description="S3 cache of model weights.")

    @model_validator(mode="after")
    def _references(self) -> StackSpec:
        groups = {g.name: g for g in self.node_groups}
        if len(groups) != len(self.node_groups):
            raise ValueError("node group names must be unique")
        names = [m.model_name for m in self.models]
        if len(set(names)) != len(names) or len({m.id for m in self.models}) != len(self.models):
            raise ValueError("model ids and served names must be unique")
        for m in self.models:
            group = groups.get(m.node_group)
            if group is None:
                raise ValueError(f"model {m.id!r}: node_group {m.node_group!r} is not defined; defined: {list(groups)}")
            if isinstance(group, CpuNodeGroup) and m.dtype not in (Dtype.FLOAT32, Dtype.AUTO):
                raise ValueError(
                    f"model {m.id!r} runs on CPU group {group.name!r}: use dtype float32 "
                    "(bfloat16 crashes CPU vLLM on CPUs without full AMX support; float16 is unsupported on CPU)"
                )
        local = isinstance(self.cloud, LocalCloud)
        if local and any(isinstance(g, GpuNodeGroup) for g in self.node_groups):
            raise ValueError("cloud.provider local runs on this machine: use kind: cpu node groups only")
        cached = [m.id for m in self.models if m.cached]
        if local and cached:
            raise ValueError(f"models {cached} set cached: true, but the model cache is an S3 bucket of an AWS "
                             "stack; a local stack loads each model from its source folder: remove cached")
        if local != isinstance(self.redis, LocalRedis):
            raise ValueError("redis.mode local goes with cloud.provider local, and only with it")
        return self

    def node_group(self, name: str) -> GpuNodeGroup | CpuNodeGroup:
        return next(g for g in self.node_groups if g.name == name)

    def model(self, model_id: str) -> ModelSpec:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(f"no model {model_id!r} in stack {self.name}; models: {[m.id for m in self.models]}")
