"""Stack models -> Ray Serve LLM `llm_configs`, and the Serve config that runs them.

The application's `args` are exactly Ray Serve LLM's `LLMServingArgs` (`{"llm_configs":
[...]}`), so an operator who knows Ray reads them directly and the stock
`ray.serve.llm:build_openai_app` could run them. We name our own builder
(`serving.app:build_app`) as the import path only so that the image and `make dev` run one
code path that we can extend (the builder itself adds nothing to the configs).

Replica autoscaling (`autoscaling_config`, `max_ongoing_requests`) is not in `args` but in
the application's `deployments:` overrides, one per model's `LLMServer` deployment. Serve
hashes `import_path`, `runtime_env` and `args` into the application's code version: a change
there rebuilds the application and restarts every replica of every model (each reloading its
weights), while a change confined to `deployments:` is applied in place to running replicas.
So `llmctl scale` (and an updated `serveConfigV2`) changes replica bounds without a restart.

On GPU node groups each engine rank asks for one GPU plus one unit of a custom resource
named after its node group. The Ray worker pods of that group advertise it (see
`rayservice.py`), so a model lands on the nodes its stack entry names and nowhere else,
without relying on Ray's accelerator auto-detection (which labels A100-40GB and A100-80GB
both as "A100").

A model with `cached: true` loads from the stack's S3 model cache: its `model_source` is Ray
Serve LLM's cloud mirror config (`{"bucket_uri": "s3://..."}`, `CloudMirrorConfig`), which
Ray downloads with boto3 on the replica's node, using the pod's IRSA role. Its
`model_loading_config.model_id` stays the served name, so clients see no difference.

The serving path (`ServingPath`, chosen by measurement, see BENCHMARKS.md) decides the shape.
On the default `direct` path each model is its own Serve application under `/<model id>`:
HAProxy forwards each request straight to an `LLMServer` replica, whose own vLLM HTTP app
streams the answer (Ray Serve LLM's direct streaming; its `LLMRouter` only picks the replica,
once per request). One more small application at `/` lists every model (`GET /v1/models`),
and the gateway routes by the body's `model` with `model_routes`. Ray reads the switches from
the environment of every Ray process at import time, so they are pod env (`serving_env`), not
part of the Serve config.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from infra.plan.cache_layout import LOCAL_BUCKET, lora_uri, model_uri
from infra.spec.model_source import resolve_local_source
from infra.spec.schema import (
    CpuNodeGroup,
    DraftModelSpeculation,
    Dtype,
    ModelSpec,
    NgramSpeculation,
    Routing,
    ScalingPolicy,
    StackSpec,
)
from serving.autoscaling.policy import POLICY_FUNCTION as SATURATION_POLICY

APP_NAME = "llm"  # the one application of the paths through an OpenAI ingress
MODELS_APP_NAME = "models"  # direct path: `GET /v1/models` for every model, at `/`
APP_IMPORT_PATH = "serving.app:build_app"
# Ray Serve LLM's LLMServer plus the engine figures Serve's autoscaler asks replicas for; only
# models scaled on saturation run it (serving.autoscaling.replica).
SATURATION_SERVER_CLS = "serving.autoscaling.replica:LLMServer"
MODELS_APP_IMPORT_PATH = "serving.app:build_model_list_app"
# Ray Serve's span exporter when the stack traces (observability.tracing): OTLP/HTTP to its collector.
TRACING_EXPORTER_IMPORT_PATH = "serving.tracing_export:otlp_span_processors"
SERVE_SERVICE_NAME = "llmstack-serve"  # OTel's service.name of every Ray process's spans (vLLM's too)
SERVE_PORT = 8000
# RFC 6761 reserves .invalid: no such host resolves, so a media URL naming it fetches nothing.
NO_REMOTE_MEDIA = "data-urls-only.invalid"


class ServingPath(str, Enum):
    """How a request travels from Serve's HTTP port to the vLLM engine."""

    DIRECT = "direct"  # HAProxy -> LLMServer replica (vLLM's HTTP app); one application per model
    HAPROXY = "haproxy"  # HAProxy -> OpenAI ingress replica -> LLMServer replica; one application
    RAY_PROXY = "ray_proxy"  # Serve's Python proxy -> OpenAI ingress -> LLMServer (Ray's default)


# The path `llmctl render` and `make dev` run; the others stay renderable so that
# `python -m ops.benchmarks.serving --paths ...` can measure them against it.
SERVING_PATH = ServingPath.DIRECT

# Serve request routers (`request_router_config.request_router_class`) per `routing:`.
# pow2 is Serve's own default, named explicitly because direct streaming otherwise picks
# round-robin (ray.llm core/ingress/builder.py, `_get_direct_streaming_serve_options`).
REQUEST_ROUTERS = {
    Routing.POW2: "ray.serve._private.request_router:PowerOfTwoChoicesRequestRouter",
    Routing.PREFIX: "ray.serve.llm.request_router:PrefixCacheAffinityRouter",
}


def node_group_resource(group_name: str) -> str:
    """Ray custom resource that pins engine ranks to a node group's workers."""
    return f"llmstack-node-group-{group_name}"


def llm_config(model: ModelSpec, spec: StackSpec, model_cache_bucket: str | None = None) -> dict[str, Any]:
    """One `ray.serve.llm.LLMConfig`, as the plain dict that goes into `serveConfigV2`.

    `model_cache_bucket`: the stack's cache bucket (`infra.plan.cache_layout.bucket_name`), needed
    when the model is `cached`."""
    group = spec.node_group(model.node_group)
    on_cpu = isinstance(group, CpuNodeGroup)
    local = spec.cloud.provider == "local"
    engine: dict[str, Any] = {
        "tensor_parallel_size": model.tensor_parallel_size,
        "pipeline_parallel_size": model.pipeline_parallel_size,
        "max_model_len": model.max_model_len,
        "dtype": Dtype.FLOAT32.value if on_cpu else model.dtype.value,
    }
    if not on_cpu:
        engine["gpu_memory_utilization"] = model.gpu_memory_utilization
    if model.quantization is not None:
        engine["quantization"] = model.quantization.value
    if model.kv_cache_dtype != "auto":
        engine["kv_cache_dtype"] = model.kv_cache_dtype
    if model.speculative_decoding is not None:
        engine["speculative_config"] = _speculative_config(model, local=local)
    if on_cpu:
        engine["enforce_eager"] = True  # no CUDA graphs on CPU; also skips a slow warm-up
    if spec.gateway.queue.enabled and spec.gateway.queue.engine_priority:
        # The gateway then sets each request's `priority` to its tier's rank (0 first); vLLM
        # refuses a non-zero priority unless the engine schedules by it (vLLM EngineArgs
        # `scheduling_policy`, "lower value means earlier handling").
        engine["scheduling_policy"] = "priority"
    # Prefix caching is what `routing: prefix` routes for; usage then reports the cached prompt
    # tokens (`prompt_tokens_details.cached_tokens`), which is how a hit rate is measured.
    engine["enable_prefix_caching"] = True
    engine["enable_prompt_tokens_details"] = True
    # The engine fetches media URLs from inside the VPC: the same hosts the gateway lets through
    # (serving.gateway.admission.media_urls). vLLM reads an empty list as "any host", so "none" is a host
    # that never resolves.
    engine["allowed_media_domains"] = spec.media_domains(model) or [NO_REMOTE_MEDIA]
    if model.lora is not None:
        engine.update(_lora_engine_args(model))
    tracing = spec.observability.tracing
    if tracing.enabled:
        # vLLM's `llm_request` span per request (queue, prefill and decode times as attributes), a
        # child of the traceparent the gateway sends (vLLM reads it from the request's headers).
        engine["otlp_traces_endpoint"] = tracing.traces_url
    engine.update(model.engine_args)

    config: dict[str, Any] = {
        "model_loading_config": {
            "model_id": model.model_name,
            "model_source": _model_source(model, local=local, model_cache_bucket=model_cache_bucket),
        },
        "engine_kwargs": engine,
        # In the LLMConfig rather than in `deployments:` because Ray's direct-streaming builder
        # reads it from there. So a routing change restarts the model's replicas.
        "deployment_config": {"request_router_config": {"request_router_class": REQUEST_ROUTERS[model.routing]}},
    }
    if model.lora is not None:
        config["lora_config"] = _lora_config(model, local=local, model_cache_bucket=model_cache_bucket)
    if model.autoscaling.policy is ScalingPolicy.SATURATION:
        # In `args`, so switching the policy restarts the model's replicas; its thresholds are in
        # `deployments:` and change in place.
        config["server_cls"] = SATURATION_SERVER_CLS
    # An allowed host must not redirect the engine elsewhere (vLLM follows redirects by default).
    env_vars = {"VLLM_MEDIA_URL_ALLOW_REDIRECTS": "0"}
    config["runtime_env"] = {"env_vars": env_vars}
    if on_cpu:
        config["placement_group_config"] = {"bundle_per_worker": {"CPU": 1}, "strategy": "PACK"}
        env_vars["VLLM_CPU_KVCACHE_SPACE"] = str(model.cpu_kv_cache_gib)
    else:
        bundle = {"GPU": 1, node_group_resource(group.name): 1}
        one_node = model.pipeline_parallel_size == 1
        config["placement_group_config"] = {
            "bundle_per_worker": bundle,
            # Tensor-parallel ranks must share a node (NVLink); pipeline stages may span nodes.
            "strategy": "STRICT_PACK" if one_node else "PACK",
        }
    return config


def _model_source(model: ModelSpec, *, local: bool, model_cache_bucket: str | None) -> str | dict[str, str]:
    if model.cached:
        if not model_cache_bucket:
            raise ValueError(f"model {model.id!r} is cached: rendering it needs the stack's model cache bucket")
        return {"bucket_uri": model_uri(model_cache_bucket, model)}
    return resolve_local_source(model.source) if local else model.source


def _lora_engine_args(model: ModelSpec) -> dict[str, Any]:
    """vLLM's LoRA switches: the GPU slots (`max_loras` x `max_lora_rank`) are reserved at start,
    whatever adapters arrive later (infra.plan.lora_memory counts them)."""
    assert model.lora is not None
    args: dict[str, Any] = {
        "enable_lora": True,
        "max_loras": model.lora.max_loras,
        "max_lora_rank": model.lora.max_lora_rank,
    }
    if model.lora.max_cpu_loras is not None:
        args["max_cpu_loras"] = model.lora.max_cpu_loras
    return args


def _lora_config(model: ModelSpec, *, local: bool, model_cache_bucket: str | None) -> dict[str, Any]:
    """Ray Serve LLM's `lora_config`: it loads `<model>:<id>` on first request from
    `<dynamic_lora_loading_path>/<id>/` with boto3 (object stores only, no local folders: the
    local stack's path is in the local S3 `make dev` runs, reached through AWS_ENDPOINT_URL_S3)."""
    assert model.lora is not None
    if local:
        bucket = LOCAL_BUCKET
    elif model_cache_bucket:
        bucket = model_cache_bucket
    else:
        raise ValueError(f"model {model.id!r} serves LoRA adapters: rendering it needs the stack's model cache bucket")
    return {
        "dynamic_lora_loading_path": lora_uri(bucket, model),
        "max_num_adapters_per_replica": model.lora.max_adapters_per_replica,
    }


def model_adapters(spec: StackSpec) -> dict[str, list[str]]:
    """Served name -> the adapter ids served on it, for the gateway (clients ask for `<name>:<id>`)."""
    return {m.model_name: [a.id for a in m.lora.adapters] for m in spec.models if m.lora is not None}


def _speculative_config(model: ModelSpec, *, local: bool) -> dict[str, Any]:
    spec = model.speculative_decoding
    if isinstance(spec, NgramSpeculation):
        return {
            "method": "ngram",
            "num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_max": spec.prompt_lookup_max,
            "prompt_lookup_min": spec.prompt_lookup_min,
        }
    assert isinstance(spec, DraftModelSpeculation)
    source = resolve_local_source(spec.model) if local else spec.model
    return {"method": "draft_model", "model": source, "num_speculative_tokens": spec.num_speculative_tokens}


def llm_deployment_name(model: ModelSpec) -> str:
    """The Serve deployment Ray Serve LLM makes for a model: `LLMServer:` + the served name
    with `/` as `--` and `.` as `_` (ray.llm's builder; a test builds the app and compares)."""
    return "LLMServer:" + model.model_name.replace("/", "--").replace(".", "_")


def deployment_overrides(model: ModelSpec, spec: StackSpec) -> dict[str, Any]:
    """One model's replica scaling, as a Serve `deployments:` entry (applied in place)."""
    scaling = model.autoscaling
    autoscaling_config: dict[str, Any] = {
        "min_replicas": scaling.min_replicas,
        "max_replicas": scaling.max_replicas,
        "target_ongoing_requests": scaling.target_ongoing_requests,
        "upscale_delay_s": scaling.upscale_delay_s,
        "downscale_delay_s": scaling.downscale_delay_s,
    }
    if scaling.policy is ScalingPolicy.SATURATION:
        autoscaling_config["policy"] = {
            "policy_function": SATURATION_POLICY,
            "policy_kwargs": saturation_policy_kwargs(model, spec),
        }
    return {
        "name": llm_deployment_name(model),
        "max_ongoing_requests": scaling.max_ongoing_requests,
        "autoscaling_config": autoscaling_config,
    }


def scales_on_saturation(spec: StackSpec) -> bool:
    """Some model scales on saturation: Serve's controller then reads the gateway's queue in Redis,
    as its own read-only user (infra.plan.redis_acl.autoscaler_user)."""
    return any(model.autoscaling.policy is ScalingPolicy.SATURATION for model in spec.models)


def saturation_policy_kwargs(model: ModelSpec, spec: StackSpec) -> dict[str, Any]:
    """`serving.autoscaling.policy.SaturationPolicy`'s arguments: the thresholds, and which
    gateway queue is the model's (none when the gateway queues nothing). No Redis URL: that is
    a secret, and the Serve config is not (it comes from the controller's environment)."""
    queue = spec.gateway.queue
    return {
        "thresholds": model.autoscaling.saturation.model_dump(mode="json"),
        "queue": {
            "model": model.model_name,
            "tiers": len(queue.tiers),
            "max_ongoing_requests": model.autoscaling.max_ongoing_requests,
            "max_replicas": model.autoscaling.max_replicas,
        }
        if queue.enabled
        else None,
    }


# Ray Serve LLM's OpenAI ingress and the autoscaling it gives itself (ray.llm's ingress
# DEFAULT_INGRESS_OPTIONS: one replica, never scaled on load). It derives min_replicas 0 from
# the models' own autoscaling when every model scales to zero; ours is not in `args`, so that
# case is stated here (a test compares it with what Ray's builder derives).
INGRESS_DEPLOYMENT = "OpenAiIngress"
INGRESS_AUTOSCALING = {"min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 1_000_000_000}


def ingress_overrides(spec: StackSpec) -> list[dict[str, Any]]:
    """An ingress that scales to zero with the models, so idle GPU nodes can be released."""
    if not all(m.autoscaling.min_replicas == 0 for m in spec.models):
        return []
    return [{"name": INGRESS_DEPLOYMENT, "autoscaling_config": {**INGRESS_AUTOSCALING, "min_replicas": 0}}]


def serving_args(spec: StackSpec, model_cache_bucket: str | None = None) -> dict[str, Any]:
    """Ray Serve LLM's `LLMServingArgs` for the whole stack."""
    return {"llm_configs": [llm_config(m, spec, model_cache_bucket) for m in spec.models]}


def app_name(model: ModelSpec, path: ServingPath = SERVING_PATH) -> str:
    """The Serve application that serves `model`."""
    return model.id if path is ServingPath.DIRECT else APP_NAME


def route_prefix(model: ModelSpec, path: ServingPath = SERVING_PATH) -> str:
    """Where Serve's HTTP port serves `model`'s OpenAI API (`<prefix>/v1/...`)."""
    return f"/{model.id}" if path is ServingPath.DIRECT else "/"


def model_routes(spec: StackSpec, path: ServingPath = SERVING_PATH) -> dict[str, str]:
    """Served name -> route prefix, for the gateway; empty when every model shares `/`."""
    if path is not ServingPath.DIRECT:
        return {}
    return {m.model_name: route_prefix(m, path) for m in spec.models}


def _model_list_app(spec: StackSpec) -> dict[str, Any]:
    return {
        "name": MODELS_APP_NAME,
        "route_prefix": "/",
        "import_path": MODELS_APP_IMPORT_PATH,
        "args": {
            "models": [
                {"id": m.model_name, "route_prefix": route_prefix(m), "max_model_len": m.max_model_len}
                for m in spec.models
            ]
        },
    }


def applications(
    spec: StackSpec, model_cache_bucket: str | None = None, path: ServingPath = SERVING_PATH
) -> list[dict[str, Any]]:
    """The Serve applications (`ServeApplicationSchema`s) of the stack on `path`."""
    if path is not ServingPath.DIRECT:
        return [
            {
                "name": APP_NAME,
                "route_prefix": "/",
                "import_path": APP_IMPORT_PATH,
                "args": serving_args(spec, model_cache_bucket),
                "deployments": [*(deployment_overrides(m, spec) for m in spec.models), *ingress_overrides(spec)],
            }
        ]
    # Direct streaming serves exactly one model per application (ray.llm's build_openai_app).
    per_model = [
        {
            "name": app_name(m, path),
            "route_prefix": route_prefix(m, path),
            "import_path": APP_IMPORT_PATH,
            "args": {"llm_configs": [llm_config(m, spec, model_cache_bucket)]},
            "deployments": [deployment_overrides(m, spec)],
        }
        for m in spec.models
    ]
    return [*per_model, _model_list_app(spec)]


def serve_config(
    spec: StackSpec, model_cache_bucket: str | None = None, path: ServingPath = SERVING_PATH
) -> dict[str, Any]:
    """A Serve deploy config (`ServeDeploySchema`): what `serveConfigV2` holds and `make dev` runs."""
    config: dict[str, Any] = {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": applications(spec, model_cache_bucket, path),
    }
    tracing = spec.observability.tracing
    if tracing.enabled:
        # Each replica's span, a child of the gateway's traceparent (parent-based sampling: the
        # ratio only applies to requests that come without one).
        config["tracing_config"] = {
            "enabled": True,
            "exporter_import_path": TRACING_EXPORTER_IMPORT_PATH,
            "sampling_ratio": tracing.sampling_ratio,
        }
    return config


# HAProxy's own ports (ray.serve constants RAY_SERVE_HAPROXY_STATS_PORT / _METRICS_PORT defaults).
# It binds them on all interfaces: alone in a pod that is fine; two stacks on one machine must
# move them (ops.devstack does).
HAPROXY_STATS_PORT = 8404
HAPROXY_METRICS_PORT = 9101


def serving_env(spec: StackSpec, path: ServingPath = SERVING_PATH, *, routers_per_node: int = 1) -> dict[str, str]:
    """Environment every Ray process of the stack needs for `path`: pod env in the cluster,
    `os.environ` before `ray.init` locally. Ray reads these at import time
    (ray.serve._private.constants, ray.llm._internal.serve.constants). `routers_per_node`:
    LLMRouter replicas of each model on each node that runs a proxy (`infra.plan.ingress_plan`)."""
    traced = tracing_env(spec)
    if path is ServingPath.RAY_PROXY:
        return traced
    # Ray's "high throughput" settings, on head and workers alike (Ray docs, "Enable High
    # Throughput on Ray Serve with KubeRay"; kuberay ray-operator/config/samples/
    # ray-service.high-throughput-llm.yaml). THROUGHPUT_OPTIMIZED runs replica code on the
    # replica's own event loop, buffers request logs and logs to files only, not stderr.
    env = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    if path is ServingPath.DIRECT:
        env["RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"] = "1"
        env["RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE"] = str(routers_per_node)
        if any(m.routing is Routing.PREFIX or m.lora is not None for m in spec.models):
            # HAProxy hands the LLMRouter the request body only when asked to; a prefix
            # router without it silently falls back to load balancing, and Ray's builder refuses
            # LoRA without it (the body's `model` names the adapter, whose replica the router picks).
            env["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] = "1"
        if any(m.autoscaling.min_replicas == 0 for m in spec.models):
            # A model scaled to zero has no replica to pick until one starts: let HAProxy wait
            # for the router as long as the gateway waits for a first byte, instead of 5 s.
            env["RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S"] = str(int(spec.gateway.upstream_idle_timeout_s))
    return {**env, **traced}


def tracing_env(spec: StackSpec) -> dict[str, str]:
    """Where Ray Serve's exporter (serving.tracing_export) and vLLM's send spans, as OTel's own
    variables: both read them in the replica process, and vLLM's engine processes inherit them.
    OTLP over HTTP for vLLM too (its default is gRPC, vllm/tracing/otel.py `get_span_exporter`)."""
    tracing = spec.observability.tracing
    if tracing.traces_url is None:
        return {}
    return {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": tracing.traces_url,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": SERVE_SERVICE_NAME,
    }
