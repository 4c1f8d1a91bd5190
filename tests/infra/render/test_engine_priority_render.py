"""The engine setting behind the gateway's per-request priority, checked the way Ray Serve LLM
builds the engine: our rendered LLMConfig -> Ray's engine kwargs -> vLLM's AsyncEngineArgs ->
vLLM's own engine config (ray.llm vllm_engine.py `_get_vllm_engine_config` does these steps)."""

from __future__ import annotations

from infra.render.serve_config import serve_config
from infra.spec.stack_file import load_stack
from ops.devstack.tiny_model import ensure_tiny_model
from serving.gateway.capacity.engine_priority import SHARE_BANDS, engine_priority


def engine_configs(spec):
    from ray.serve.llm import LLMConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    for app in serve_config(spec)["applications"]:
        for config in app["args"].get("llm_configs", []):
            kwargs = LLMConfig.model_validate(config).get_engine_config().get_initialization_kwargs()
            yield AsyncEngineArgs(**kwargs).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)


def test_the_engine_schedules_by_the_priority_the_gateway_sends_only_when_the_stack_says_so():
    ensure_tiny_model()  # `make dev`'s models: the engine config reads their config.json
    spec = load_stack("local")
    queue = spec.gateway.queue.model_copy(update={"engine_priority": True})
    prioritized = spec.model_copy(update={"gateway": spec.gateway.model_copy(update={"queue": queue})})
    assert [c.scheduler_config.policy for c in engine_configs(prioritized)] == ["priority", "priority"]
    assert [c.scheduler_config.policy for c in engine_configs(spec)] == ["fcfs", "fcfs"]


def test_vllm_accepts_every_priority_the_gateway_derives():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tiers = len(load_stack("local").gateway.queue.tiers)
    worst = engine_priority(tiers - 1, held=10_000, capacity=1, holders=1)
    assert worst == tiers * SHARE_BANDS - 1
    for priority in (0, worst):
        request = ChatCompletionRequest.model_validate(
            {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "priority": priority}
        )
        assert request.priority == priority
