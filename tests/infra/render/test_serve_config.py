"""Replica autoscaling lives in the Serve config's `deployments:` overrides, so changing it
does not change the application's code version (no rebuild, no engine restart)."""

from __future__ import annotations

import pytest

from infra.render.serve_config import serve_config
from infra.stack_file import load_stack, spec_from_document
from tests.support.stacks import EXAMPLE_STACKS, stack_document


@pytest.mark.parametrize("stack", EXAMPLE_STACKS)
def test_override_names_are_the_deployments_ray_builds(stack):
    from ray.serve._private.build_app import build_app as build_serve_app

    from serving.app import build_app

    app = serve_config(load_stack(stack))["applications"][0]
    built = build_serve_app(build_app(app["args"]), name=app["name"])
    llm_deployments = {d.name for d in built.deployments if d.name.startswith("LLMServer:")}
    assert {d["name"] for d in app["deployments"]} == llm_deployments
    assert all("deployment_config" not in c for c in app["args"]["llm_configs"])


def test_changing_replica_bounds_keeps_the_code_version():
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    def version(autoscaling: dict) -> str:
        doc = stack_document(models=[{"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct",
                                      "node_group": "l4", "max_model_len": 8192, "autoscaling": autoscaling}])
        spec = spec_from_document(doc, name="t", file_label="t")
        return get_app_code_version(ServeApplicationSchema.model_validate(serve_config(spec)["applications"][0]))

    assert version({"min_replicas": 1, "max_replicas": 2}) == version(
        {"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 8})

    # ...while what the engines load is part of it: a changed model is a rebuild, as it must be.
    doc = stack_document(models=[{"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4",
                                  "max_model_len": 4096, "autoscaling": {"min_replicas": 1, "max_replicas": 2}}])
    other = serve_config(spec_from_document(doc, name="t", file_label="t"))["applications"][0]
    assert get_app_code_version(ServeApplicationSchema.model_validate(other)) != version(
        {"min_replicas": 1, "max_replicas": 2})


def test_ingress_scales_to_zero_with_the_models_as_ray_would_make_it():
    """When every model has min_replicas 0, Ray's builder gives the ingress min_replicas 0 (so
    GPU nodes can drain); our override states the same, and nothing otherwise."""
    from ray.serve._private.build_app import build_app as build_serve_app

    from serving.app import build_app

    def spec(min_replicas: int):
        doc = stack_document(models=[{"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4",
                                      "max_model_len": 8192, "autoscaling": {"min_replicas": min_replicas}}])
        return spec_from_document(doc, name="t", file_label="t")

    app = serve_config(spec(0))["applications"][0]
    [ingress] = [d for d in app["deployments"] if d["name"] == "OpenAiIngress"]
    # What Ray derives when the models' autoscaling is in their LLMConfig (its own input form).
    args = {"llm_configs": [{**c, "deployment_config": {"autoscaling_config": {"min_replicas": 0}}}
                            for c in app["args"]["llm_configs"]]}
    built = build_serve_app(build_app(args), name="llm")
    ray_ingress = next(d for d in built.deployments if d.name == "OpenAiIngress")._deployment_config.autoscaling_config
    assert (ray_ingress.min_replicas, ray_ingress.max_replicas, ray_ingress.target_ongoing_requests) == (
        ingress["autoscaling_config"]["min_replicas"], ingress["autoscaling_config"]["max_replicas"],
        ingress["autoscaling_config"]["target_ongoing_requests"])
    assert all(d["name"] != "OpenAiIngress" for d in serve_config(spec(1))["applications"][0]["deployments"])


def test_engine_priority_turns_on_vllms_priority_scheduling_for_every_model():
    import dataclasses

    from ray.serve.llm import LLMConfig
    from vllm.engine.arg_utils import EngineArgs

    document = stack_document(gateway={"allow_plaintext": True, "queue": {"engine_priority": True}})
    configs = serve_config(spec_from_document(document, name="t", file_label="Pulumi.t.yaml")
                           )["applications"][0]["args"]["llm_configs"]
    assert all(c["engine_kwargs"]["scheduling_policy"] == "priority" for c in configs)
    assert "scheduling_policy" in {f.name for f in dataclasses.fields(EngineArgs)}  # the argument vLLM reads
    for config in configs:
        LLMConfig.model_validate(config)
    plain = serve_config(spec_from_document(stack_document(), name="t", file_label="Pulumi.t.yaml"))
    assert "scheduling_policy" not in plain["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]


def test_engine_priority_refuses_a_model_that_schedules_first_come_first_served():
    from infra.stack_file import StackFileError

    model = {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 8192,
             "engine_args": {"scheduling_policy": "fcfs"}}
    document = stack_document(models=[model], gateway={"allow_plaintext": True, "queue": {"engine_priority": True}})
    with pytest.raises(StackFileError, match="scheduling_policy"):
        spec_from_document(document, name="t", file_label="Pulumi.t.yaml")
