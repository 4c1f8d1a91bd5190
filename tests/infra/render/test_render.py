"""Rendered manifests, validated by the real validators for every example stack:
KubeRay's v1.7.0 CRD schema, kubernetes-validate, Ray's ServeDeploySchema and LLMConfig."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infra.catalog.versions import KUBERNETES_VERSION
from infra.plan.planner import plan_stack
from infra.render import RenderRefused, render_stack, to_yaml
from infra.render.common import COMPONENT_LABEL
from infra.render.serve_config import node_group_resource
from infra.spec.schema import GpuNodeGroup
from infra.spec.stack_file import spec_from_document
from tests.support.stacks import SCHEMAS, stack_document


def crd_schema(kind_file: str) -> dict:
    path = SCHEMAS / kind_file
    assert path.is_file(), f"KubeRay CRD schemas expected at {SCHEMAS} (the shared/ folder beside the repo)"
    crd = yaml.safe_load(path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return version["schema"]["openAPIV3Schema"]


def strict(schema: dict) -> dict:
    """The schema with unknown fields forbidden wherever the API server would prune them, so a
    misspelled field fails here instead of vanishing silently in the cluster."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        if "properties" in schema:
            out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


@pytest.fixture(scope="module")
def rendered(example_stack):
    # Round-trip through YAML so we validate what `llmctl render` writes, not Python objects.
    return example_stack, list(yaml.safe_load_all(to_yaml(render_stack(example_stack))))


def test_rayservice_matches_kuberay_crd(rendered):
    _, objects = rendered
    [rayservice] = by_kind(objects, "RayService")
    validator = jsonschema.Draft7Validator(strict(crd_schema("ray.io_rayservices.yaml")))
    errors = sorted(validator.iter_errors(rayservice), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def test_crd_validation_can_fail(rendered):
    _, objects = rendered
    broken = json.loads(json.dumps(by_kind(objects, "RayService")[0]))
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = "two"
    validator = jsonschema.Draft7Validator(strict(crd_schema("ray.io_rayservices.yaml")))
    assert list(validator.iter_errors(broken))
    typo = json.loads(json.dumps(by_kind(objects, "RayService")[0]))
    typo["spec"]["rayClusterConfig"]["enableInTreeAutoscalling"] = True
    assert list(validator.iter_errors(typo))


def test_core_objects_are_valid_kubernetes(rendered):
    _, objects = rendered
    core = [o for o in objects if o["kind"] != "RayService"]
    assert {o["kind"] for o in core} >= {
        "Namespace",
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for obj in core:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION + ".0", strict=True)


def test_serve_config_is_valid_for_ray_serve(rendered):
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    from serving.app import ModelListArgs

    spec, objects = rendered
    serve = yaml.safe_load(by_kind(objects, "RayService")[0]["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve)
    *model_apps, model_list = serve["applications"]
    assert {a["import_path"] for a in model_apps} == {"serving.app:build_app"}
    configs = [c for a in model_apps for c in a["args"]["llm_configs"]]
    assert [c["model_loading_config"]["model_id"] for c in configs] == [m.model_name for m in spec.models]
    for config in configs:
        LLMConfig.model_validate(config)
    assert model_list["import_path"] == "serving.app:build_model_list_app"
    ModelListArgs.model_validate(model_list["args"])


def test_every_ray_pod_gets_the_serving_path_env(rendered):
    from infra.render.serve_config import serving_env

    spec, objects = rendered
    cluster = by_kind(objects, "RayService")[0]["spec"]["rayClusterConfig"]
    wanted = serving_env(spec, routers_per_node=plan_stack(spec).ingress.routers_per_node)
    assert wanted["RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING"] == "1"
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert wanted.items() <= env.items()


# Worker-group node bounds of the example stacks, worked out by hand from their files:
# local: one CPU node. dev: l4 is g6.2xlarge (1 GPU), models at 1..2 replicas of 1 GPU -> 1..2 nodes.
# prod: a100 is p4de (8 GPUs), the 70B model at TP 4 fits 2 replicas per node, 2..4 replicas -> 1..2
# nodes; l40s (1 GPU) 1..6 replicas -> 1..6; a10g-spot (1 GPU) 0..4 replicas -> 0..4.
WORKER_BOUNDS = {
    "local": {"local": (1, 1)},
    "dev": {"l4": (1, 2)},
    "prod": {"a100": (1, 2), "l40s": (1, 6), "a10g-spot": (0, 4)},
    # tests/stacks/Pulumi.karpenter.yaml: a10g is g5.2xlarge (1 GPU), 1..2 replicas -> 1..2; l4-spot
    # is g6.xlarge (1 GPU), 0..4 replicas -> 0..4.
    "karpenter": {"a10g": (1, 2), "l4-spot": (0, 4)},
}


def test_worker_groups_follow_the_plan(rendered):
    spec, objects = rendered
    cluster = by_kind(objects, "RayService")[0]["spec"]["rayClusterConfig"]
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    for worker in cluster["workerGroupSpecs"]:
        group = spec.node_group(worker["groupName"])
        assert (worker["minReplicas"], worker["maxReplicas"]) == WORKER_BOUNDS[spec.name][group.name]
        pod = worker["template"]["spec"]
        assert node_group_resource(group.name) in worker["rayStartParams"]["resources"]
        if isinstance(group, GpuNodeGroup):
            assert int(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) >= 1
            assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_secrets_are_referenced_never_inlined(rendered):
    _, objects = rendered
    text = to_yaml(objects)
    rayservice = by_kind(objects, "RayService")[0]
    options = rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]
    for credential in (options["redisUsername"], options["redisPassword"]):
        # Ray signs in as its own Redis user, never with the gateway's secret.
        assert "value" not in credential and credential["valueFrom"]["secretKeyRef"]["name"] == "llmstack-redis-ray"
    assert "kind: Secret" not in text
    env = by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert next(e for e in env if e["name"] == "LLMSTACK_REDIS_URL")["valueFrom"]["secretKeyRef"]


def test_only_the_gateway_reaches_ray_serve(rendered):
    spec, objects = rendered
    policy = next(p for p in by_kind(objects, "NetworkPolicy") if p["metadata"]["name"] == "llmstack-ray-ingress")
    assert policy["spec"]["podSelector"]["matchLabels"] == {COMPONENT_LABEL: "ray"}
    serve_rule = next(r for r in policy["spec"]["ingress"] if r.get("ports") == [{"protocol": "TCP", "port": 8000}])
    assert serve_rule["from"] == [{"podSelector": {"matchLabels": {COMPONENT_LABEL: "gateway"}}}]
    gateway_rules = [
        r
        for r in policy["spec"]["ingress"]
        if {"podSelector": {"matchLabels": {COMPONENT_LABEL: "gateway"}}} in r.get("from", [])
    ]
    # Serve's port only; the dashboard's (which also takes job submissions) only when the stack
    # opts in to live replica counts.
    assert sorted(p["port"] for r in gateway_rules for p in r["ports"]) == (
        [8000, 8265] if spec.gateway.queue.live_replicas else [8000]
    )
    services = by_kind(objects, "Service")
    load_balancers = [s for s in services if s["spec"].get("type") == "LoadBalancer"]
    expected = ["llmstack-gateway"] if spec.cloud.provider == "aws" else []
    assert [s["metadata"]["name"] for s in load_balancers] == expected


def test_local_serve_args_are_ray_serve_llm_serving_args():
    """What `serving.app:build_app` hands to Ray's `build_openai_app`, checked with Ray's own
    model and without a Ray cluster (building the app needs one: tests/e2e/test_serve_app.py
    builds it on the shared dev stack's Ray)."""
    from ray.serve.llm import LLMServingArgs

    from infra.render.serve_config import serving_args
    from infra.spec.stack_file import load_stack

    spec = load_stack("local")
    args = LLMServingArgs.model_validate(serving_args(spec))
    assert [c.model_id for c in args.llm_configs] == [m.model_name for m in spec.models]


def test_render_refuses_a_stack_that_fails_its_plan():
    doc = stack_document(
        models=[{"id": "m", "source": "meta-llama/Llama-3.3-70B-Instruct", "node_group": "l4", "max_model_len": 4096}]
    )
    with pytest.raises(RenderRefused, match="weights"):
        render_stack(spec_from_document(doc, name="t", file_label="t"))


def test_tls_redis_is_addressed_by_its_own_host_name():
    from infra.render.rayservice import redis_address

    external = stack_document(redis={"mode": "external", "host": "redis.example.internal", "port": 6380})
    assert (
        redis_address(spec_from_document(external, name="t", file_label="t")) == "rediss://redis.example.internal:6380"
    )
    managed = spec_from_document(stack_document(redis={"mode": "managed"}), name="t", file_label="t")
    [rayservice] = by_kind(render_stack(managed, gcs_redis_address="rediss://master.example:6379"), "RayService")
    assert (
        rayservice["spec"]["rayClusterConfig"]["gcsFaultToleranceOptions"]["redisAddress"]
        == "rediss://master.example:6379"
    )
