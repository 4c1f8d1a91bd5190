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
"""

from __future__ import annotations

from typing import Any

from infra.model_cache import model_uri
from infra.model_source import resolve_local_source
from infra.spec import CpuNodeGroup, DraftModelSpeculation, Dtype, ModelSpec, NgramSpeculation, StackSpec

APP_NAME = "llm"
APP_IMPORT_PATH = "serving.app:build_app"
SERVE_PORT = 8000


def node_group_resource(group_name: str) -> str:
    """Ray custom resource that pins engine ranks to a node group's workers."""
    return f"llmstack-node-group-{group_name}"


def llm_config(model: ModelSpec, spec: StackSpec, model_cache_bucket: str | None = None) -> dict[str, Any]:
    """One `ray.serve.llm.LLMConfig`, as the plain dict that goes into `serveConfigV2`.

    `model_cache_bucket`: the stack's cache bucket (`infra.model_cache.bucket_name`), needed
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
    engine.update(model.engine_args)

    config: dict[str, Any] = {
        "model_loading_config": {"model_id": model.model_name, "model_source": _model_source(
            model, local=local, model_cache_bucket=model_cache_bucket)},
        "engine_kwargs": engine,
    }
    if on_cpu:
        config["placement_group_config"] = {"bundle_per_worker": {"CPU": 1}, "strategy": "PACK"}
        config["runtime_env"] = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": str(model.cpu_kv_cache_gib)}}
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


def _speculative_config(model: ModelSpec, *, local: bool) -> dict[str, Any]:
    spec = model.speculative_decoding
    if isinstance(spec, NgramSpeculation):
        return {"method": "ngram", "num_speculative_tokens": spec.num_speculative_tokens,
                "prompt_lookup_max": spec.prompt_lookup_max, "prompt_lookup_min": spec.prompt_lookup_min}
    assert isinstance(spec, DraftModelSpeculation)
    source = resolve_local_source(spec.model) if local else spec.model
    return {"method": "draft_model", "model": source, "num_speculative_tokens": spec.num_speculative_tokens}


def llm_deployment_name(model: ModelSpec) -> str:
    """The Serve deployment Ray Serve LLM makes for a model: `LLMServer:` + the served name
    with `/` as `--` and `.` as `_` (ray.llm's builder; a test builds the app and compares)."""
    return "LLMServer:" + model.model_name.replace("/", "--").replace(".", "_")


def deployment_overrides(model: ModelSpec) -> dict[str, Any]:
    """One model's replica scaling, as a Serve `deployments:` entry (applied in place)."""
    scaling = model.autoscaling
    return {
        "name": llm_deployment_name(model),
        "max_ongoing_requests": scaling.max_ongoing_requests,
        "autoscaling_config": {
            "min_replicas": scaling.min_replicas,
            "max_replicas": scaling.max_replicas,
            "target_ongoing_requests": scaling.target_ongoing_requests,
            "upscale_delay_s": scaling.upscale_delay_s,
            "downscale_delay_s": scaling.downscale_delay_s,
        },
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


def serve_config(spec: StackSpec, model_cache_bucket: str | None = None) -> dict[str, Any]:
    """A Serve deploy config (`ServeDeploySchema`): what `serveConfigV2` holds and `make dev` runs."""
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": "0.0.0.0", "port": SERVE_PORT},
        "applications": [{
            "name": APP_NAME,
            "route_prefix": "/",
            "import_path": APP_IMPORT_PATH,
            "args": serving_args(spec, model_cache_bucket),
            "deployments": [*(deployment_overrides(m) for m in spec.models), *ingress_overrides(spec)],
        }],
    }
