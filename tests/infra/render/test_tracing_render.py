"""observability.tracing reaches every layer in the form each reads, checked against the pinned
Ray and vLLM: Serve's TracingConfig (ServeDeploySchema) naming an exporter Ray can load, vLLM's
`otlp_traces_endpoint` through Ray's LLMConfig into vLLM's own observability config, the
environment both exporters read, and the gateway's settings. Off: none of it is rendered."""

from __future__ import annotations

import json

from infra.render.gateway import gateway_settings
from infra.render.serve_config import serve_config, serving_env
from infra.spec.stack_file import load_stack
from ops.devstack.runner import traced
from ops.devstack.tiny_model import ensure_tiny_model
from serving.gateway.config.settings import GatewaySettings

COLLECTOR = "http://otel-collector.monitoring:4318"


def test_tracing_off_renders_nothing_of_it():
    spec = load_stack("local")
    assert not spec.observability.tracing.enabled
    config = serve_config(spec)
    assert "tracing_config" not in config
    engines = [c["engine_kwargs"] for a in config["applications"] for c in a["args"].get("llm_configs", [])]
    assert engines and all("otlp_traces_endpoint" not in e for e in engines)
    assert not any(name.startswith("OTEL_") for name in serving_env(spec))
    assert json.loads(gateway_settings(spec))["tracing"]["otlp_endpoint"] is None


def test_every_layer_gets_the_collector_and_the_sampling():
    from ray.serve._private.tracing_utils import _load_span_processors
    from ray.serve.schema import ServeDeploySchema

    ensure_tiny_model()
    spec = traced(load_stack("local"), COLLECTOR)
    config = serve_config(spec)
    schema = ServeDeploySchema.model_validate(config)
    assert schema.tracing_config is not None and schema.tracing_config.enabled
    assert schema.tracing_config.sampling_ratio == 1.0
    # Ray loads the exporter by its import path and checks what it returns (span processors).
    processors = _load_span_processors(schema.tracing_config.exporter_import_path, "unused")
    assert len(processors) == 1
    for processor in processors:
        processor.shutdown()
    env = serving_env(spec)
    assert env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] == COLLECTOR + "/v1/traces"
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert [c.observability_config.otlp_traces_endpoint for c in engine_configs(config)] == [
        COLLECTOR + "/v1/traces"
    ] * 2
    settings = GatewaySettings(upstream_url="http://u:1", **json.loads(gateway_settings(spec)))
    assert settings.tracing.traces_url == COLLECTOR + "/v1/traces"
    assert settings.tracing.sampling_ratio == 1.0


def engine_configs(config: dict):
    """vLLM's engine configs as Ray Serve LLM builds them (ray.llm vllm_engine.py `_get_vllm_engine_config`)."""
    from ray.serve.llm import LLMConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    for app in config["applications"]:
        for llm in app["args"].get("llm_configs", []):
            kwargs = LLMConfig.model_validate(llm).get_engine_config().get_initialization_kwargs()
            yield AsyncEngineArgs(**kwargs).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
