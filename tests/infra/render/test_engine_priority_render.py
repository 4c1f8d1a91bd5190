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


def test_vllms_priority_queue_serves_the_tenant_under_its_share_first():
    # The pinned vLLM's own waiting queue (what `scheduling_policy: priority` makes the scheduler
    # use) pops the lower priority first, whatever arrived first: a tenant over its share that
    # came first waits behind one under its share, and a higher tier beats both.
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.request_queue import SchedulingPolicy, create_request_queue
    from vllm.v1.request import Request

    over = engine_priority(1, held=48, capacity=64, holders=4)
    under = engine_priority(1, held=3, capacity=64, holders=4)
    higher_tier = engine_priority(0, held=64, capacity=64, holders=1)
    queue = create_request_queue(SchedulingPolicy.PRIORITY)
    for arrival, (name, priority) in enumerate([("over", over), ("under", under), ("higher tier", higher_tier)]):
        queue.add_request(
            Request(name, [1, 2, 3], SamplingParams(max_tokens=1), None, arrival_time=float(arrival), priority=priority)
        )
    assert [queue.pop_request().request_id for _ in range(3)] == ["higher tier", "under", "over"]
