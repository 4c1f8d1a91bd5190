"""A model's `lora:` block rendered: Ray Serve LLM's lora_config and vLLM's LoRA engine args, checked
by Ray's own LLMConfig; the gateway learns which adapters each model serves."""

from __future__ import annotations

import json

import pytest

from infra.render.gateway import gateway_settings
from infra.render.serve_config import llm_config, serve_config
from infra.spec.stack_file import load_stack, spec_from_document
from tests.support.stacks import stack_document

BASE = "meta-llama/Llama-3.1-8B-Instruct"
LORA = {
    "max_loras": 4,
    "max_lora_rank": 32,
    "max_cpu_loras": 8,
    "max_adapters_per_replica": 12,
    "adapters": [
        {"id": "support", "source": "s3://team-adapters/support", "base_model": BASE},
        {"id": "legal", "source": "s3://team-adapters/legal", "base_model": BASE},
    ],
}


def cloud_spec():
    doc = stack_document(
        models=[{"id": "llama", "source": BASE, "node_group": "l4", "max_model_len": 8192, "lora": LORA}]
    )
    return spec_from_document(doc, name="test", file_label="Pulumi.test.yaml")


def test_a_cloud_model_loads_its_adapters_from_the_model_cache_and_ray_accepts_the_config():
    from ray.serve.llm import LLMConfig

    spec = cloud_spec()
    config = llm_config(spec.model("llama"), spec, model_cache_bucket="llmstack-test-models-111122223333")
    assert config["lora_config"] == {
        "dynamic_lora_loading_path": "s3://llmstack-test-models-111122223333/loras/llama",
        "max_num_adapters_per_replica": 12,
    }
    engine = config["engine_kwargs"]
    assert (engine["enable_lora"], engine["max_loras"], engine["max_lora_rank"], engine["max_cpu_loras"]) == (
        True,
        4,
        32,
        8,
    )
    validated = LLMConfig.model_validate(config)
    assert validated.lora_config.dynamic_lora_loading_path == "s3://llmstack-test-models-111122223333/loras/llama"
    assert validated.lora_config.max_num_adapters_per_replica == 12


def test_rendering_adapters_without_the_cache_bucket_is_refused():
    spec = cloud_spec()
    with pytest.raises(ValueError, match="needs the stack's model cache bucket"):
        llm_config(spec.model("llama"), spec)


def test_a_model_without_lora_gets_no_lora_settings():
    spec = spec_from_document(stack_document(), name="test", file_label="Pulumi.test.yaml")
    config = llm_config(spec.model("llama"), spec)
    assert "lora_config" not in config and "enable_lora" not in config["engine_kwargs"]


def test_the_local_stack_serves_its_adapters_from_the_local_s3_and_ray_accepts_the_serve_config():
    from ray.serve.llm import LLMConfig
    from ray.serve.schema import ServeDeploySchema

    spec = load_stack("local")
    config = serve_config(spec)
    ServeDeploySchema.model_validate(config)
    [chat] = [a for a in config["applications"] if a["name"] == "tiny-chat"]
    [llm] = chat["args"]["llm_configs"]
    assert LLMConfig.model_validate(llm).lora_config.dynamic_lora_loading_path == (
        "s3://llmstack-local-models/loras/tiny-chat"
    )
    [ngram] = [a for a in config["applications"] if a["name"] == "tiny-chat-ngram"]
    assert "lora_config" not in ngram["args"]["llm_configs"][0]


def test_the_gateway_learns_which_adapters_each_base_serves():
    settings = json.loads(gateway_settings(load_stack("local")))
    assert settings["model_adapters"] == {"tiny-chat": ["sql", "pirate"]}
    assert json.loads(gateway_settings(cloud_spec()))["model_adapters"] == {"llama": ["support", "legal"]}


def test_the_gateway_accepts_the_rendered_settings():
    from serving.gateway.config.settings import GatewaySettings

    rendered = json.loads(gateway_settings(load_stack("local")))
    settings = GatewaySettings.model_validate({**rendered, "upstream_url": "http://127.0.0.1:8000"})  # pod env
    assert settings.model_adapters == {"tiny-chat": ["sql", "pirate"]}


def test_the_pods_forward_the_body_to_the_router_which_ray_requires_for_lora():
    """Ray's direct-streaming builder refuses LoRA unless HAProxy hands the LLMRouter the body
    (whose `model` names the adapter); test_serve_config builds the local stack's app under this env."""
    from infra.render.serve_config import serving_env

    assert serving_env(load_stack("local"))["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] == "1"
    assert serving_env(cloud_spec())["RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY"] == "1"
