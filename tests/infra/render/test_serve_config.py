"""The Serve config of each serving path: what Ray builds from it, what restarts engines,
and the environment the pods get. Replica autoscaling lives in the `deployments:` overrides,
so changing it does not change the application's code version (no rebuild, no restart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from infra.render.serve_config import (
    MODELS_APP_NAME,
    REQUEST_ROUTERS,
    ServingPath,
    app_name,
    model_routes,
    serve_config,
    serving_env,
)
from infra.spec.schema import Routing
from infra.spec.stack_file import PROJECT_ROOT, load_stack, spec_from_document
from tests.support.stacks import EXAMPLE_STACKS, stack_document

# Ray reads the serving path's switches at import time: an application built under them has
# to be built in a process that had them from the start. Ray's LLM builder asks the driver's
# runtime env, which would start a local cluster: a driver without one has an empty env.
BUILD_IN_ENV = """
import json, sys
from types import SimpleNamespace
import ray
ray.get_runtime_context = lambda: SimpleNamespace(runtime_env={})
from ray.serve._private.build_app import build_app as build_serve_app
from serving.app import build_app
app = json.loads(sys.argv[1])
built = build_serve_app(build_app(app["args"]), name=app["name"])
router = [built.ingress_request_router_deployment.name] if built.ingress_request_router_deployment else []
print(json.dumps(sorted([d.name for d in built.deployments] + router)))
"""


def built_deployments(app: dict, env: dict[str, str]) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", BUILD_IN_ENV, json.dumps(app)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=PROJECT_ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def spec_with(**model):
    doc = stack_document(
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                **model,
            }
        ]
    )
    return spec_from_document(doc, name="t", file_label="t")


@pytest.mark.parametrize("stack", EXAMPLE_STACKS)
def test_direct_path_is_one_application_per_model_and_the_list(stack):
    spec = load_stack(stack)
    apps = serve_config(spec)["applications"]
    assert [a["name"] for a in apps] == [*(m.id for m in spec.models), MODELS_APP_NAME]
    assert [a["route_prefix"] for a in apps] == [*(f"/{m.id}" for m in spec.models), "/"]
    assert model_routes(spec) == {m.model_name: f"/{m.id}" for m in spec.models}
    for app, model in zip(apps, spec.models):
        [config] = app["args"]["llm_configs"]
        assert config["model_loading_config"]["model_id"] == model.model_name
        # Only routing is in the LLMConfig's deployment_config; scaling stays in the overrides.
        assert config["deployment_config"] == {
            "request_router_config": {"request_router_class": REQUEST_ROUTERS[model.routing]}
        }
    assert apps[-1]["args"]["models"] == [
        {"id": m.model_name, "route_prefix": f"/{m.id}", "max_model_len": m.max_model_len} for m in spec.models
    ]


def test_override_names_are_the_deployments_ray_builds_under_the_pods_env():
    spec = load_stack("local")
    for path in (ServingPath.DIRECT, ServingPath.HAPROXY):
        app = serve_config(spec, path=path)["applications"][0]
        built = built_deployments(app, serving_env(spec, path))
        llm = {name for name in built if name.startswith("LLMServer:")}
        assert {d["name"] for d in app["deployments"]} == llm
        expected_ingress = "LLMRouter" if path is ServingPath.DIRECT else "OpenAiIngress"
        assert set(built) - llm == {expected_ingress}


def test_routing_renders_rays_router_classes_which_import():
    from ray.serve.config import RequestRouterConfig

    for routing in Routing:
        config = serve_config(spec_with(routing=routing.value))["applications"][0]["args"]["llm_configs"][0]
        router = config["deployment_config"]["request_router_config"]
        assert router["request_router_class"] == REQUEST_ROUTERS[routing]
        assert RequestRouterConfig(**router).get_request_router_class().__name__ in (
            "PowerOfTwoChoicesRequestRouter",
            "PrefixCacheAffinityRouter",
        )
    assert config["engine_kwargs"]["enable_prefix_caching"] is True


def test_serving_env_per_path():
    pow2, prefix, zero = spec_with(), spec_with(routing="prefix"), spec_with(autoscaling={"min_replicas": 0})
    assert serving_env(pow2, ServingPath.RAY_PROXY) == {}
    fast = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}
    assert serving_env(pow2, ServingPath.HAPROXY) == fast
    assert serving_env(pow2, routers_per_node=3) == {
        **fast,
        "RAY_SERVE_LLM_ENABLE_DIRECT_STREAMING": "1",
        "RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE": "3",
    }
    # A prefix router needs the body HAProxy otherwise keeps from the LLMRouter.
    assert serving_env(prefix)["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] == "1"
    assert "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY" not in serving_env(pow2)
    assert serving_env(zero)["RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_TIMEOUT_S"] == "120"


def test_the_env_names_are_what_ray_reads():
    """Each variable we set is read by the installed Ray (a renamed one would be ignored silently)."""
    import ray

    root = Path(ray.__file__).parent
    sources = (root / "serve" / "_private" / "constants.py").read_text() + (
        root / "llm" / "_internal" / "serve" / "constants.py"
    ).read_text()
    spec = spec_with(routing="prefix", autoscaling={"min_replicas": 0})
    for name in serving_env(spec):
        assert f'"{name}"' in sources, name


def test_changing_replica_bounds_keeps_the_code_version():
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeApplicationSchema

    def version(autoscaling: dict) -> str:
        return get_app_code_version(
            ServeApplicationSchema.model_validate(serve_config(spec_with(autoscaling=autoscaling))["applications"][0])
        )

    assert version({"min_replicas": 1, "max_replicas": 2}) == version(
        {"min_replicas": 2, "max_replicas": 3, "target_ongoing_requests": 8}
    )

    # ...while what the engines load is part of it: a changed model is a rebuild, as it must be.
    other = serve_config(spec_with(max_model_len=4096, autoscaling={"min_replicas": 1, "max_replicas": 2}))
    assert get_app_code_version(ServeApplicationSchema.model_validate(other["applications"][0])) != version(
        {"min_replicas": 1, "max_replicas": 2}
    )


def test_ingress_scales_to_zero_with_the_models_as_ray_would_make_it(monkeypatch):
    """On the paths through an OpenAI ingress: when every model has min_replicas 0, Ray's builder
    gives the ingress min_replicas 0 (so GPU nodes can drain); our override states the same."""
    import ray
    from ray.serve._private.build_app import build_app as build_serve_app

    # Ray's LLM builder asks the driver's runtime env, which would start a local cluster: a
    # driver without one has an empty env, which is all the builder reads.
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(runtime_env={}))

    from serving.app import build_app

    def app(min_replicas: int) -> dict:
        return serve_config(spec_with(autoscaling={"min_replicas": min_replicas}), path=ServingPath.RAY_PROXY)[
            "applications"
        ][0]

    [ingress] = [d for d in app(0)["deployments"] if d["name"] == "OpenAiIngress"]
    # What Ray derives when the models' autoscaling is in their LLMConfig (its own input form).
    args = {
        "llm_configs": [
            {**c, "deployment_config": {"autoscaling_config": {"min_replicas": 0}}}
            for c in app(0)["args"]["llm_configs"]
        ]
    }
    built = build_serve_app(build_app(args), name="llm")
    ray_ingress = next(d for d in built.deployments if d.name == "OpenAiIngress")._deployment_config.autoscaling_config
    assert (ray_ingress.min_replicas, ray_ingress.max_replicas, ray_ingress.target_ongoing_requests) == (
        ingress["autoscaling_config"]["min_replicas"],
        ingress["autoscaling_config"]["max_replicas"],
        ingress["autoscaling_config"]["target_ongoing_requests"],
    )
    assert all(d["name"] != "OpenAiIngress" for d in app(1)["deployments"])
    assert app_name(load_stack("local").models[0], ServingPath.RAY_PROXY) == "llm"


def llm_configs(config: dict) -> list[dict]:
    """Every model's LLMConfig in a rendered Serve config (direct path: one application each)."""
    return [c for app in config["applications"] for c in app["args"].get("llm_configs", [])]


def test_engine_priority_turns_on_vllms_priority_scheduling_for_every_model():
    import dataclasses

    from ray.serve.llm import LLMConfig
    from vllm.engine.arg_utils import EngineArgs

    document = stack_document(gateway={"allow_plaintext": True, "queue": {"engine_priority": True}})
    configs = llm_configs(serve_config(spec_from_document(document, name="t", file_label="Pulumi.t.yaml")))
    assert configs and all(c["engine_kwargs"]["scheduling_policy"] == "priority" for c in configs)
    assert "scheduling_policy" in {f.name for f in dataclasses.fields(EngineArgs)}  # the argument vLLM reads
    for config in configs:
        LLMConfig.model_validate(config)
    plain = llm_configs(serve_config(spec_from_document(stack_document(), name="t", file_label="Pulumi.t.yaml")))
    assert all("scheduling_policy" not in c["engine_kwargs"] for c in plain)


def test_engine_priority_refuses_a_model_that_schedules_first_come_first_served():
    from infra.spec.stack_file import StackFileError

    model = {
        "id": "llama",
        "source": "meta-llama/Llama-3.1-8B-Instruct",
        "node_group": "l4",
        "max_model_len": 8192,
        "engine_args": {"scheduling_policy": "fcfs"},
    }
    document = stack_document(models=[model], gateway={"allow_plaintext": True, "queue": {"engine_priority": True}})
    with pytest.raises(StackFileError, match="scheduling_policy"):
        spec_from_document(document, name="t", file_label="Pulumi.t.yaml")


def test_the_engine_fetches_media_only_from_the_hosts_the_gateway_lets_through():
    """Each engine gets the media hosts its model's requests may carry past the gateway
    (serving.gateway.admission.media_urls), under the argument vLLM reads, and follows no redirects."""
    import dataclasses

    from ray.serve.llm import LLMConfig
    from vllm.engine.arg_utils import EngineArgs

    from infra.render.gateway import gateway_settings
    from infra.render.serve_config import NO_REMOTE_MEDIA
    from serving.gateway.config.settings import load_settings

    models = [
        {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 8192},
        {
            "id": "pixtral",
            "source": "mistralai/Pixtral-12B-2409",
            "node_group": "l4",
            "max_model_len": 8192,
            "allowed_media_domains": [],
        },
    ]
    for gateway_domains, expected in (
        ([], {"llama": [NO_REMOTE_MEDIA], "pixtral": [NO_REMOTE_MEDIA]}),
        (["images.example.com"], {"llama": ["images.example.com"], "pixtral": [NO_REMOTE_MEDIA]}),
    ):
        spec = spec_from_document(
            stack_document(models=models, gateway={"allow_plaintext": True, "allowed_media_domains": gateway_domains}),
            name="t",
            file_label="t",
        )
        configs = {c["model_loading_config"]["model_id"]: c for c in llm_configs(serve_config(spec))}
        assert {m: c["engine_kwargs"]["allowed_media_domains"] for m, c in configs.items()} == expected
        assert all(c["runtime_env"]["env_vars"]["VLLM_MEDIA_URL_ALLOW_REDIRECTS"] == "0" for c in configs.values())
        for config in configs.values():
            LLMConfig.model_validate(config)
        settings = load_settings(
            {"LLMSTACK_UPSTREAM_URL": "http://serve:8000", "LLMSTACK_GATEWAY_SETTINGS": gateway_settings(spec)}
        )
        for model in ("llama", "pixtral"):  # what the gateway lets through, the engine may fetch
            assert (settings.media_domains(model) or [NO_REMOTE_MEDIA]) == expected[model]
    assert "allowed_media_domains" in {f.name for f in dataclasses.fields(EngineArgs)}


@pytest.mark.parametrize(
    "domains",
    [
        ["169.254.169.254"],
        ["http://images.example.com"],
        ["*.example.com"],
        ["Images.example.com"],
        ["images.example.com:443"],
        ["localhost"],
    ],
)
def test_media_domains_must_be_plain_host_names(domains):
    from infra.spec.stack_file import StackFileError

    with pytest.raises(StackFileError, match="allowed_media_domains"):
        spec_from_document(
            stack_document(gateway={"allow_plaintext": True, "allowed_media_domains": domains}),
            name="t",
            file_label="t",
        )
    with pytest.raises(StackFileError, match="allowed_media_domains"):
        spec_with(allowed_media_domains=domains)
    with pytest.raises(StackFileError, match="engine_args"):
        spec_with(engine_args={"allowed_media_domains": ["images.example.com"]})


def test_the_engine_refuses_remote_media_with_the_list_it_is_rendered_with():
    """Defence in depth behind the gateway: vLLM's own check, given the rendered engine arg,
    refuses the metadata service in any spelling (vLLM reads an empty list as "any host", hence
    the .invalid host for "none"). Importing vLLM's media code costs seconds on a busy machine."""
    from urllib3.util import parse_url
    from vllm.multimodal.media.connector import MediaConnector

    from infra.render.serve_config import NO_REMOTE_MEDIA

    allowed = "images.example.com"
    for domains in ([NO_REMOTE_MEDIA], [allowed]):
        connector = MediaConnector(allowed_media_domains=domains)
        for url in [
            "http://169.254.169.254/latest/meta-data/",
            "http://0xa9fea9fe/",
            f"https://{allowed}@169.254.169.254/",
        ]:
            with pytest.raises(ValueError, match="allowed domains"):
                connector._assert_url_in_allowed_media_domains(parse_url(url))
    MediaConnector(allowed_media_domains=[allowed])._assert_url_in_allowed_media_domains(
        parse_url(f"https://{allowed}/x.png")
    )
