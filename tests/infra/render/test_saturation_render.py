"""`autoscaling.policy: saturation` in the rendered Serve config: the policy in the model's
`autoscaling_config` (in place), the reporting server class in its LLMConfig, both accepted by
Ray's own schemas and builder; a model on `ongoing` renders exactly as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from infra.render.serve_config import (
    SATURATION_SERVER_CLS,
    ServingPath,
    llm_config,
    serve_config,
    serving_env,
)
from infra.spec.stack_file import PROJECT_ROOT, spec_from_document
from tests.support.stacks import stack_document

SATURATION = {
    "policy": "saturation",
    "min_replicas": 1,
    "max_replicas": 3,
    "saturation": {"kv_cache_high": 0.85, "kv_cache_low": 0.4},
}


def two_models(**gateway):
    base = {"source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 8192}
    doc = stack_document(
        models=[
            {"id": "hot", **base, "autoscaling": SATURATION},
            {"id": "plain", **base, "served_name": "plain-llama"},
        ],
        gateway={"allow_plaintext": True, **gateway},
    )
    return spec_from_document(doc, name="t", file_label="t")


def model_app(config: dict, name: str) -> dict:
    return next(a for a in config["applications"] if a["name"] == name)


def test_the_policy_and_its_thresholds_are_in_the_deployment_override():
    spec = two_models()
    hot, plain = (model_app(serve_config(spec), m.id)["deployments"][0]["autoscaling_config"] for m in spec.models)
    assert hot["policy"]["policy_function"] == "serving.autoscaling.policy:SaturationPolicy"
    kwargs = hot["policy"]["policy_kwargs"]
    assert kwargs["thresholds"]["kv_cache_high"] == 0.85 and kwargs["thresholds"]["kv_cache_low"] == 0.4
    assert kwargs["queue"] == {
        "model": "hot",
        "tiers": len(spec.gateway.queue.tiers),
        "max_ongoing_requests": 64,
        "max_replicas": 3,
    }
    assert "redis" not in json.dumps(kwargs).lower()  # the URL (a secret) comes from the controller's env
    assert "policy" not in plain  # ongoing: Serve's default policy, config unchanged


def test_only_the_ray_head_gets_the_controllers_redis_url_and_only_with_a_saturation_model():
    """Serve's controller runs on the head; workers run tenant input and never see the URL."""
    from infra.plan.planner import plan_stack
    from infra.render.rayservice import rayservice

    def env_names(spec) -> tuple[set[str], set[str]]:
        cluster = rayservice(spec, plan_stack(spec))["spec"]["rayClusterConfig"]
        head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
        workers = [g["template"]["spec"]["containers"][0]["env"] for g in cluster["workerGroupSpecs"]]
        return {e["name"] for e in head}, {e["name"] for w in workers for e in w}

    head, workers = env_names(two_models())
    assert "LLMSTACK_AUTOSCALING_REDIS_URL" in head and "LLMSTACK_AUTOSCALING_REDIS_URL" not in workers
    ongoing = spec_from_document(stack_document(gateway={"allow_plaintext": True}), name="o", file_label="o")
    assert "LLMSTACK_AUTOSCALING_REDIS_URL" not in set.union(*env_names(ongoing))


def test_no_gateway_queue_means_no_queue_to_watch():
    spec = two_models(queue={"enabled": False})
    kwargs = model_app(serve_config(spec), "hot")["deployments"][0]["autoscaling_config"]["policy"]["policy_kwargs"]
    assert kwargs["queue"] is None


def test_ray_accepts_the_rendered_config_and_llm_configs():
    from ray.serve.config import AutoscalingConfig
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    from serving.autoscaling.replica import LLMServer

    spec = two_models()
    config = serve_config(spec)
    schema = ServeDeploySchema.model_validate(config)
    hot = next(a for a in schema.applications if a.name == "hot").deployments[0]
    parsed = AutoscalingConfig(**hot.autoscaling_config)
    assert not parsed.policy.is_default_policy_function()
    hot_llm, plain_llm = (LLMConfig.model_validate(llm_config(m, spec)) for m in spec.models)
    assert hot_llm.server_cls is LLMServer
    assert plain_llm.server_cls is None
    assert llm_config(spec.models[0], spec)["server_cls"] == SATURATION_SERVER_CLS


BUILD = """
import json, sys
from ray.serve._private.build_app import build_app as build_serve_app
from serving.app import build_app
app = json.loads(sys.argv[1])
built = build_serve_app(build_app(app["args"]), name=app["name"])
print(json.dumps({d.name: hasattr(d.func_or_class, "record_autoscaling_stats") for d in built.deployments}))
"""


def test_rays_builder_names_the_deployment_as_the_override_and_it_reports():
    spec = two_models()
    app = model_app(serve_config(spec), "hot")
    out = subprocess.run(
        [sys.executable, "-c", BUILD, json.dumps(app)],
        capture_output=True,
        text=True,
        env={**os.environ, **serving_env(spec, ServingPath.DIRECT)},
        cwd=PROJECT_ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    built = json.loads(out.stdout.strip().splitlines()[-1])
    assert built == {app["deployments"][0]["name"]: True}  # `LLMServer:hot`, with the report Serve polls
