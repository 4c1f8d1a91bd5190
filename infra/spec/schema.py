"""The stack spec: everything a user states about one environment, as typed models.

A stack file (`Pulumi.<stack>.yaml`) holds these under `config:` as `llmstack:<key>`
entries. `infra.spec.stack_file.load_stack` reads and validates them once; every consumer
(`llmctl plan`, `llmctl render`, the Pulumi program, `make dev`) takes a `StackSpec` and
never reads the YAML itself, so they cannot disagree.

Validators here check what one model can check about itself. Checks that need the GPU
catalog or model architecture (does it fit?) live in `infra.plan.planner`.
"""

from __future__ import annotations

import ipaddress
import re
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infra.catalog import versions
from infra.catalog.gpu_catalog import GpuClass, InstanceType, default_instance_for, load_catalog
from infra.catalog.images import missing_registry_problem

# The Serve autoscaling policy reads the same thresholds; one model keeps a field and its bound in one place.
from serving.autoscaling.decision import SaturationThresholds

# The gateway validates the same policy at start; one model keeps a field and its bound in one place.
from serving.gateway.config.capacity_policy import LatencyTarget
from serving.gateway.config.gateway_policy import GatewayPolicy, checked_domains
from serving.gateway.config.tracing_policy import TracingPolicy

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?$"


class _Spec(BaseModel):
    """Strict base: unknown keys are typos, and typos in infrastructure config are bugs."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class SpecError(ValueError):
    """Problems found across sections, each at the key path where the author fixes it.

    `problems` holds `(key path under llmstack:, message)` pairs; `infra.spec.stack_file` prints one
    line per pair, naming the file and the key."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{key}: {message}" for key, message in problems))


# --- cloud -------------------------------------------------------------------------------


class AwsCloud(_Spec):
    provider: Literal["aws"] = Field(description="Provision on AWS (EKS).")
    region: str = Field(description="AWS region, e.g. us-east-1. Defaults to `aws:region`.")
    availability_zones: list[str] = Field(
        min_length=2,
        description="Zones for subnets and node groups; EKS needs at least two.",
    )
    kubernetes_version: str = Field(
        default=versions.KUBERNETES_VERSION, pattern=r"^1\.\d+$", description="EKS version, e.g. 1.35."
    )
    upgrade_policy: Literal["standard", "extended"] = Field(
        description="What EKS does when the version leaves standard support: `standard` upgrades the control "
        "plane automatically (plan ahead: `llmctl plan` warns), `extended` keeps it at about six "
        "times the hourly price. Required: the choice costs money either way.",
    )
    node_provisioner: Literal["cluster-autoscaler", "karpenter"] = Field(
        default="cluster-autoscaler",
        description="What starts GPU nodes: `cluster-autoscaler` (one managed node group per GPU group) or "
        "`karpenter` (a NodePool per GPU group, any instance type of that GPU class, spot "
        "interruption handling).",
    )
    admin_principal_arns: list[str] = Field(
        default_factory=list,
        description="IAM roles or users (besides the identity running `pulumi up`) given cluster-admin "
        "access entries, e.g. arn:aws:iam::111122223333:role/platform-admins.",
    )
    api_public_cidrs: list[str] = Field(
        default_factory=lambda: ["0.0.0.0/0"],
        min_length=1,
        description="CIDRs allowed to reach the EKS API's public endpoint (requests are still IAM-authenticated). "
        "Default open; `llmctl plan` warns. E.g. your office and CI egress ranges.",
    )

    @field_validator("admin_principal_arns")
    @classmethod
    def _principal_arns(cls, arns: list[str]) -> list[str]:
        for arn in arns:
            if not re.fullmatch(r"arn:aws[a-z-]*:iam::\d{12}:(role|user)/[\w+=,.@/-]+", arn):
                raise ValueError(
                    f"{arn!r} is not an IAM role or user ARN (arn:aws:iam::<account>:role/<name>); "
                    "EKS access entries take no assumed-role session ARNs: give the role's ARN"
                )
        return arns

    @field_validator("api_public_cidrs")
    @classmethod
    def _cidrs(cls, cidrs: list[str]) -> list[str]:
        for cidr in cidrs:
            try:
                ipaddress.IPv4Network(cidr)
            except ValueError as exc:
                raise ValueError(f"{cidr!r} is not an IPv4 CIDR such as 203.0.113.0/24 ({exc})") from None
        return cidrs

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

    @property
    def instance(self) -> InstanceType:
        """The group's entry in the GPU catalog (validation resolved its instance type)."""
        assert self.instance_type is not None, "set by _resolve_instance"
        return load_catalog()[self.instance_type]


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


class ScalingPolicy(str, Enum):
    """What Serve scales a model's replicas on (`autoscaling_config.policy`)."""

    ONGOING = "ongoing"  # Serve's default: requests in flight per replica against target_ongoing_requests
    SATURATION = "saturation"  # serving.autoscaling: engine waiting, KV cache use, the gateway queue's depth and wait


class Autoscaling(_Spec):
    """Ray Serve autoscaling for one model's replicas (names follow `autoscaling_config`)."""

    policy: ScalingPolicy = Field(
        default=ScalingPolicy.ONGOING,
        description="`ongoing`: Serve's default, replicas follow the requests in flight (target_ongoing_requests). "
        "`saturation`: replicas follow what fills an LLM replica and what users wait for: requests "
        "waiting in vLLM, its KV cache use, and the gateway queue's depth and expected wait for the "
        "model (thresholds in `saturation`). Suits long prompts at low concurrency, which fill the KV "
        "cache long before the in-flight count reaches its target. Switching restarts the model's "
        "replicas (its server class changes); the thresholds change in place.",
    )
    saturation: SaturationThresholds = Field(
        default_factory=SaturationThresholds,
        description="With policy saturation: when the replicas count as full (any signal) and as idle (all quiet).",
    )

    min_replicas: int = Field(default=1, ge=0, description="Replicas kept when idle.")
    max_replicas: int = Field(default=1, ge=1, description="Most replicas under load.")
    target_ongoing_requests: float = Field(default=16, gt=0, description="Per-replica load Serve aims for.")
    max_ongoing_requests: int = Field(default=64, ge=1, description="Per-replica cap; beyond it requests queue.")
    upscale_delay_s: float = Field(default=30, ge=0, description="Sustained load before adding replicas.")
    downscale_delay_s: float = Field(default=600, ge=0, description="Sustained idleness before removing.")
    cold_start_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="With min_replicas 0: how long the gateway holds a request while a replica starts. "
        "Default: the cold start `llmctl plan` expects, with a margin; a shorter value is refused.",
    )

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
    max_position_embeddings: int | None = Field(
        default=None, ge=1, description="Longest position the rotary table covers (vLLM keeps it on each GPU)."
    )


# vLLM's LoRAConfig.max_lora_rank takes only these values (vllm/config/lora.py `MaxLoRARanks`, 0.32.0).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Ray Serve LLM names an adapter `<model id>:<adapter id>` and reads everything after the first
# `:` as the adapter's folder under dynamic_lora_loading_path; a folder name stays one S3 key segment.
ADAPTER_ID = r"^[a-z0-9]([-_a-z0-9]{0,62}[a-z0-9])?$"


def same_base_model(trained_on: str, source: str) -> bool:
    """Whether an adapter's base names the model's source: the same hub id, or the same folder
    name (adapters are often trained on a local copy, `/data/Llama-3.1-8B` for `meta-llama/Llama-3.1-8B`)."""

    def name(s: str) -> str:
        return s.rstrip("/").rsplit("/", 1)[-1].lower()

    return trained_on.rstrip("/") == source.rstrip("/") or name(trained_on) == name(source)


class LoraAdapter(_Spec):
    """One fine-tuned adapter the stack serves on its model."""

    id: str = Field(
        pattern=ADAPTER_ID,
        description="The adapter's name: clients ask for `<model>:<id>`, and it is its folder under the "
        "model's adapter prefix.",
    )
    source: str = Field(
        description="Where the adapter's files are now (adapter_config.json, adapter_model.safetensors): a local "
        "folder or an s3:// prefix. `llmctl models sync` copies them beside the base (a local stack: into "
        "the dev stack's local S3).",
    )
    base_model: str = Field(
        description="The base model it was trained on, as its adapter_config.json says "
        "(`base_model_name_or_path`); checked against the file and against the model's source.",
    )


class Lora(_Spec):
    """Multi-LoRA on one model: vLLM holds `max_loras` adapters on the GPU at a time; Ray Serve LLM
    downloads an adapter on its first request from the stack's model cache (`loras/<model id>/<id>/`;
    the local stack: its local S3) and keeps `max_adapters_per_replica` of them per replica."""

    max_loras: int = Field(
        default=1,
        ge=1,
        description="Adapters one batch may mix (vLLM `max_loras`): GPU slots reserved at start, each the size "
        "of a rank-`max_lora_rank` adapter on every linear layer (`llmctl plan` counts them).",
    )
    max_lora_rank: int = Field(
        default=16,
        description=f"Largest adapter rank served (vLLM `max_lora_rank`, one of {', '.join(map(str, LORA_RANKS))}); "
        "each slot is this wide whatever the adapter's own rank.",
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        description="Adapters vLLM keeps in host memory to swap into a GPU slot without reading disk "
        "(vLLM `max_cpu_loras`); at least max_loras. None: max_loras.",
    )
    max_adapters_per_replica: int = Field(
        default=16,
        ge=1,
        description="Adapters one replica keeps downloaded (Ray Serve LLM `max_num_adapters_per_replica`); the "
        "least recently used is dropped beyond it.",
    )
    adapters: list[LoraAdapter] = Field(min_length=1, description="The adapters served on this model.")

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, rank: int) -> int:
        if rank not in LORA_RANKS:
            fits = min((r for r in LORA_RANKS if r >= rank), default=LORA_RANKS[-1])
            raise ValueError(f"vLLM takes max_lora_rank in {list(LORA_RANKS)}; use {fits}")
        return rank

    @model_validator(mode="after")
    def _consistent(self) -> Lora:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras {self.max_cpu_loras} is below max_loras {self.max_loras} (vLLM refuses it): "
                f"raise max_cpu_loras to {self.max_loras} or more, or remove it"
            )
        ids = [a.id for a in self.adapters]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            raise ValueError(f"adapter ids {twice} appear twice: give each adapter its own id")
        return self

    @property
    def cpu_loras(self) -> int:
        """vLLM's effective `max_cpu_loras`."""
        return self.max_cpu_loras or self.max_loras


# Engine settings llmstack owns: set them with the typed field, not engine_args.
MANAGED_ENGINE_ARGS = frozenset(
    {
        "model",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_model_len",
        "gpu_memory_utilization",
        "dtype",
        "quantization",
        "kv_cache_dtype",
        "speculative_config",
        "served_model_name",
        "allowed_media_domains",
        "enable_lora",
        "max_loras",
        "max_lora_rank",
        "max_cpu_loras",
    }
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
    latency_target: LatencyTarget = Field(
        default_factory=LatencyTarget,
        description="The TTFT and inter-token latency the model's streams should keep, and the gateway's capacity "
        "that adapts to keep them (requests beyond it wait in the gateway's fair queue).",
    )
    cached: bool = Field(
        default=False,
        description="Load the weights from the stack's S3 model cache (`llmctl models sync`) instead of "
        "downloading `source` on every new node. AWS stacks only.",
    )
    allowed_media_domains: list[str] | None = Field(
        default=None,
        description='Hosts this model may fetch media (image, audio, video URLs) from, e.g. ["images.example.com"]; '
        "[] allows inline data: URLs only. None: the gateway-wide gateway.allowed_media_domains. The "
        "gateway refuses other URLs and the engine gets the same list (--allowed-media-domains).",
    )
    lora: Lora | None = Field(
        default=None,
        description="Fine-tuned LoRA adapters served on this model, clients asking for `<model>:<adapter id>`: the GPU "
        "slots vLLM reserves for them and the adapters themselves (`llmctl plan` checks each against the model).",
    )
    engine_args: dict[str, Any] = Field(default_factory=dict, description="Extra vLLM engine args.")

    @field_validator("allowed_media_domains")
    @classmethod
    def _media_domains(cls, value: list[str] | None) -> list[str] | None:
        return None if value is None else checked_domains(value)

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
    mode: Literal["external"] = Field(
        description="A Redis you run, with two ACL users (docs/deploying.md: the gateway's and Ray's); their "
        "passwords are the secret config values `llmstack:redis_password` and "
        "`llmstack:redis_ray_password`. A model on `autoscaling.policy: saturation` needs a third, "
        "Serve's controller's read-only user (`llmstack:redis_autoscaler_password`)."
    )
    host: str = Field(description="Host name reachable from the cluster.")
    port: int = Field(default=6379, ge=1, le=65535, description="Port.")
    tls: bool = Field(default=True, description="Connect with TLS.")
    gateway_user: str = Field(default="llmstack-gateway", description="ACL user of the gateway (keys `llmstack:*`).")
    ray_user: str = Field(default="llmstack-ray", description="ACL user of Ray GCS (keys `RAY*`).")
    autoscaler_user: str = Field(
        default="llmstack-autoscaler",
        description="Read-only ACL user of Serve's controller (keys `llmstack:{fq:*`), for models with "
        "`autoscaling.policy: saturation`; its password is the secret config value "
        "`llmstack:redis_autoscaler_password`.",
    )


class LocalRedis(_Spec):
    mode: Literal["local"] = Field(
        description="`make dev`: a private redis-server if installed, else the gateway's in-memory store."
    )


Redis = Annotated[ManagedRedis | InClusterRedis | ExternalRedis | LocalRedis, Field(discriminator="mode")]


class Edge(_Spec):
    """HAProxy on the gateway's public port (`infra.render.edge`): the one process that talks to
    clients before any key is checked. It reads a request's headers itself and opens a connection
    to the gateway only for a request whose headers are complete and within bounds, so clients
    without a key hold neither the gateway's connections nor its memory. Chosen by measurement
    over uvicorn's own settings, hypercorn and granian (BENCHMARKS.md, "The public port under
    connection attacks")."""

    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=120,
        description="Longest a client may take to send a request's complete headers, counted from the connection's "
        "start or the end of its previous response (idle time included): past it, 408 and the "
        "connection is closed (HAProxy `timeout http-request` and `timeout http-keep-alive`).",
    )
    max_header_bytes: int = Field(
        default=16_384,
        ge=4_096,
        le=1_048_576,
        description="Largest request headers; larger gets 431 and the connection is closed (headers over this plus "
        "16 KiB do not fit HAProxy's buffer: its own 400). A connection holds at most two such buffers.",
    )
    max_connections_per_client: int = Field(
        default=64,
        ge=1,
        description="Open connections one client address (an IPv6 /64) may hold per pod; more are refused at connect "
        "(the address as the load balancer reports it with the PROXY protocol).",
    )
    max_connections: int = Field(
        default=2_048,
        ge=16,
        description="Open connections the edge of one pod holds; past it new connections wait in the kernel's "
        "accept queue. Only requests with complete headers reach the gateway (its own `max_connections`).",
    )


class Gateway(GatewayPolicy):
    """The gateway's policy (limits, ceilings, timeouts: serving.gateway.config.gateway_policy) plus how it is
    deployed."""

    edge: Edge = Field(
        default_factory=Edge, description="The public port's HTTP front (HAProxy), before any key check."
    )

    min_replicas: int = Field(default=2, ge=1, description="Gateway pods kept (HPA minimum).")
    max_replicas: int = Field(default=6, ge=1, description="HPA maximum.")
    certificate_arn: str | None = Field(default=None, description="ACM certificate for TLS on the NLB.")
    allow_plaintext: bool = Field(
        default=False,
        description="Serve the internet-facing NLB without TLS (plain HTTP, API keys in clear). AWS stacks "
        "without `certificate_arn` are refused unless this says true; `llmctl plan` warns.",
    )

    metrics_namespace: str = Field(
        default="monitoring",
        pattern=DNS_LABEL,
        description="Namespace of the Prometheus that scrapes the gateway: the only pods that reach metrics_port.",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Gateway:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class Observability(_Spec):
    """What the stack reports about each request beyond metrics and the access log."""

    tracing: TracingPolicy = Field(
        default_factory=TracingPolicy,
        description="OpenTelemetry traces: the gateway's request and stage spans, Ray Serve's replica span and "
        "vLLM's engine span (queue, prefill, decode times) in one trace per request. Off unless otlp_endpoint is set.",
    )
    prometheus_service: str = Field(
        default="prometheus-server:80",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(:[a-z0-9]([-a-z0-9]*[a-z0-9])?)?$",
        description="The Service (`name:port`, in gateway.metrics_namespace) of the Prometheus that scrapes the "
        "stack; `llmctl status` asks it which LoRA adapters each replica holds, through the Kubernetes API "
        "server's service proxy (needs get on services/proxy there). The default is the Prometheus community "
        "chart's server installed as release `prometheus`.",
    )


class Versions(_Spec):
    serving_image: str = Field(
        default=versions.SERVING_IMAGE,
        description=f"Ray cluster image: {versions.RAY_LLM_IMAGE} plus llmstack (serving/images/serving.Dockerfile).",
    )
    gateway_image: str = Field(default=versions.GATEWAY_IMAGE, description="llmstack gateway image.")
    kuberay_operator: str = Field(
        default=versions.KUBERAY_VERSION,
        pattern=r"^\d+\.\d+\.\d+$",
        description="KubeRay operator chart version that `pulumi up` installs.",
    )


class ModelCache(_Spec):
    """The stack's S3 model cache. Naming rule and layout: `infra.plan.cache_layout`."""

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
    observability: Observability = Field(
        default_factory=Observability, description="Tracing (metrics and logs need no settings)."
    )
    versions: Versions = Field(default_factory=Versions, description="Pinned versions.")
    model_cache: ModelCache = Field(default_factory=ModelCache, description="S3 cache of model weights.")

    @model_validator(mode="after")
    # Complex on purpose: one validator for every cross-reference, so a stack file's mistakes come together.
    def _references(self) -> StackSpec:  # noqa: C901
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
            raise ValueError(
                f"models {cached} set cached: true, but the model cache is an S3 bucket of an AWS "
                "stack; a local stack loads each model from its source folder: remove cached"
            )
        if local != isinstance(self.redis, LocalRedis):
            raise ValueError("redis.mode local goes with cloud.provider local, and only with it")
        problems = self._adapter_problems(local=local)
        if not local:
            problems += self._cloud_problems()
        if problems:
            raise SpecError(problems)
        if self.gateway.queue.engine_priority:
            fcfs = [m.id for m in self.models if m.engine_args.get("scheduling_policy", "priority") != "priority"]
            if fcfs:
                raise ValueError(
                    f"gateway.queue.engine_priority sends each request's tier to vLLM as its priority, "
                    f"but models {fcfs} set engine_args.scheduling_policy otherwise: remove it"
                )
        return self

    def _adapter_problems(self, *, local: bool) -> list[tuple[str, str]]:
        """Adapters trained on another base than their model's, and sources a stack cannot reach."""
        problems = []
        first_model: dict[str, str] = {}
        for i, model in enumerate(self.models):
            for j, adapter in enumerate(model.lora.adapters if model.lora else []):
                key = f"models[{i}].lora.adapters[{j}]"
                other = first_model.setdefault(adapter.id, model.id)
                if other != model.id:
                    # Ray Serve LLM 2.60 keeps a downloaded adapter on the node in a folder named by the
                    # adapter id alone (LoraModelLoader: /tmp/ray/llm/lora/cache/<id>): two models' adapters
                    # of one id on one node would overwrite each other.
                    problems.append(
                        (
                            f"{key}.id",
                            f"model {other!r} already serves an adapter {adapter.id!r}, and Ray Serve LLM keeps "
                            "adapters on a node by id alone: give this one another id",
                        )
                    )
                if not same_base_model(adapter.base_model, model.source):
                    problems.append(
                        (
                            f"{key}.base_model",
                            f"adapter {adapter.id!r} was trained on {adapter.base_model!r}, but model {model.id!r} "
                            f"serves {model.source!r}: an adapter only fits the base it was trained on; list it under "
                            "a model with that source",
                        )
                    )
                if local and adapter.source.startswith("s3://"):
                    problems.append(
                        (
                            f"{key}.source",
                            f"adapter {adapter.id!r}: a local stack reads adapters from local folders (make dev copies "
                            "them into its local S3); download it and give the folder",
                        )
                    )
        return problems

    def _cloud_problems(self) -> list[tuple[str, str]]:
        """What a cluster cannot run: images it cannot pull, a public endpoint in clear."""
        problems = []
        for field in ("gateway_image", "serving_image"):
            problem = missing_registry_problem(getattr(self.versions, field))
            if problem:
                problems.append((f"versions.{field}", problem))
        gateway = self.gateway
        if gateway.certificate_arn is None and not gateway.allow_plaintext:
            problems.append(
                (
                    "gateway.certificate_arn",
                    (
                        "the gateway's load balancer is internet-facing and would serve API keys in clear; set an ACM "
                        "certificate ARN (TLS on port 443), or say gateway.allow_plaintext: true for a throwaway stack"
                    ),
                )
            )
        return problems

    def media_domains(self, model: ModelSpec) -> list[str]:
        """The hosts `model` may fetch media from: its own list, else the gateway's."""
        own = model.allowed_media_domains
        return self.gateway.allowed_media_domains if own is None else own

    def node_group(self, name: str) -> GpuNodeGroup | CpuNodeGroup:
        return next(g for g in self.node_groups if g.name == name)

    def model(self, model_id: str) -> ModelSpec:
        for m in self.models:
            if m.id == model_id:
                return m
        raise KeyError(f"no model {model_id!r} in stack {self.name}; models: {[m.id for m in self.models]}")
