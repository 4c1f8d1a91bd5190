"""Gateway controls beyond the limits themselves: shadow mode, what is added to upstream
requests (max_tokens, best_of reservation), timeouts, Prometheus metrics and prompt logging.

Real redis-server, real gateway apps under uvicorn, the recording fake upstream of
test_gateway_limits, the official openai client where natural. No wall-clock assertions:
timeouts are set short and the tests only check what happened, not how fast.
"""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.auth.keys import RedisKeyStore
from serving.gateway.http.app import create_app
from serving.gateway.metering.output_bound import CHAT, OutputBound, output_bound
from serving.gateway.metering.reservation import reserve
from tests.support.openai_fakes import (
    PROMPT,
    USAGE,
    chat_raw,
    client,
    new_key,
    serving_gateway,
    settings_for,
)
from tests.support.servers import serving


@pytest.fixture(scope="module")
def gateway_urls(redis_server, stream_recording_upstream):
    settings = settings_for(
        stream_recording_upstream.url,
        redis_server.url,
        max_tokens_ceiling=100,
        model_context_lengths={"tiny": 4096, "other": 64},
    )
    with serving_gateway(settings, RedisKeyStore(redis_server.url)) as urls:
        yield urls


@pytest.fixture(scope="module")
def gateway(gateway_urls) -> str:
    return gateway_urls[0]


@pytest.fixture(scope="module")
def admin(gateway_urls) -> str:
    """The metrics port."""
    return gateway_urls[1]


def samples(admin: str) -> dict[tuple[str, frozenset], float]:
    """/metrics parsed with prometheus_client's own parser: {(name, labels): value}."""
    text = httpx.get(f"{admin}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(admin: str, name: str, **labels: str) -> float:
    return samples(admin).get((name, frozenset(labels.items())), 0.0)


# --- pure decisions ------------------------------------------------------------------------------


def test_max_tokens_is_sent_only_when_the_context_would_not_bound_output():
    chat = {"messages": []}
    assert output_bound(chat, CHAT, context_length=4096, ceiling=100) == OutputBound(100, added_max_tokens=100)
    assert output_bound(chat, CHAT, context_length=64, ceiling=100) == OutputBound(64)  # the context bounds it
    assert output_bound(chat, CHAT, context_length=None, ceiling=100) == OutputBound(100, added_max_tokens=100)


def test_every_generated_sequence_is_reserved():
    def output(**body) -> int:
        document = {"prompt": "abcd", "max_tokens": 10, **body}
        bound = output_bound(document, "/v1/completions", context_length=None, ceiling=100)
        return reserve(document, 40, "/v1/completions", output=bound, context_length=None, template_tokens=0).output

    assert output() == 10
    assert output(n=2) == 20
    assert output(n=2, best_of=3) == 20  # vLLM 0.32 has no best_of: it generates n sequences
    assert output(n=2, prompt=["a", "b", "c"]) == 60  # each prompt generates n sequences


# --- through a running gateway -------------------------------------------------------------------


def test_max_tokens_is_added_only_when_needed(gateway, stream_recording_upstream, redis_server):  # noqa: F811
    key = new_key(redis_server)
    stream_recording_upstream.bodies.clear()
    for model in ("tiny", "other"):
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
        assert (
            httpx.post(
                f"{gateway}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ).status_code
            == 200
        )
    assert chat_raw(gateway, key, max_tokens=7).status_code == 200
    sent = [(b["model"], b.get("max_tokens")) for b in stream_recording_upstream.bodies]
    assert sent == [("tiny", 100), ("other", None), ("tiny", 7)]


def test_shadow_key_is_served_over_its_limit_and_the_refusal_is_logged(gateway, admin, redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="llmstack.gateway.access")
    logging.getLogger("llmstack.gateway.access").disabled = False  # vLLM's dictConfig may disable it
    shadow = new_key(redis_server, requests_per_minute=2)
    enforced = new_key(redis_server, requests_per_minute=2)
    key_id = shadow.split("_")[0].removeprefix("sk-llm-")
    before = value(admin, "llmstack_gateway_rate_limited_total", limit="requests", mode="shadow")
    asyncio_update(redis_server.url, key_id, shadow=True)
    assert [chat_raw(gateway, shadow, max_tokens=5).status_code for _ in range(4)] == [200] * 4
    assert [chat_raw(gateway, enforced, max_tokens=5).status_code for _ in range(4)] == [200, 200, 429, 429]
    assert value(admin, "llmstack_gateway_rate_limited_total", limit="requests", mode="shadow") == before + 2
    lines = [json.loads(r.getMessage()) for r in caplog.records if "shadow_rate_limited" in r.getMessage()]
    assert [(line["key_id"], line["limit"]) for line in lines] == [(key_id, "requests")] * 2


def asyncio_update(redis_url: str, key_id: str, **changes) -> None:
    import asyncio

    async def go():
        store = RedisKeyStore(redis_url)
        try:
            assert await store.update(key_id, **changes) is not None
        finally:
            await store.aclose()

    asyncio.run(go())


def test_request_too_large_is_not_retried_by_the_openai_sdk(gateway, admin, redis_server):
    key = new_key(redis_server, tokens_per_minute=50)
    before = value(admin, "llmstack_gateway_rate_limited_total", limit="tokens", mode="enforced")
    llm = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=3)
    with pytest.raises(openai.RateLimitError) as caught:
        llm.chat.completions.create(model="tiny", max_tokens=90, messages=[{"role": "user", "content": PROMPT}])
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in caught.value.response.headers
    assert value(admin, "llmstack_gateway_rate_limited_total", limit="tokens", mode="enforced") == before + 1


def test_metrics_count_requests_tokens_and_ttft(gateway, admin, redis_server):
    key = new_key(redis_server)
    llm = client(gateway, key)
    tenant = {"model": "tiny", "tenant": "acme"}
    before = {
        name: value(admin, name, **labels)
        for name, labels in [
            ("llmstack_gateway_requests_total", {"status": "200", **tenant}),
            ("llmstack_gateway_tokens_total", {"kind": "completion", **tenant}),
            ("llmstack_gateway_time_to_first_token_seconds_count", {"model": "tiny"}),
        ]
    }
    llm.chat.completions.create(model="tiny", max_tokens=20, messages=[{"role": "user", "content": PROMPT}])
    list(
        llm.chat.completions.create(
            model="tiny", max_tokens=20, stream=True, messages=[{"role": "user", "content": PROMPT}]
        )
    )
    chat_raw(gateway, key, model="no-such-model-" + "x" * 50, max_tokens=5)  # junk names share one label
    assert (
        value(admin, "llmstack_gateway_requests_total", status="200", **tenant)
        == before["llmstack_gateway_requests_total"] + 2
    )
    assert (
        value(admin, "llmstack_gateway_tokens_total", kind="completion", **tenant)
        == before["llmstack_gateway_tokens_total"] + 2 * USAGE["completion_tokens"]
    )
    assert (
        value(admin, "llmstack_gateway_time_to_first_token_seconds_count", model="tiny")
        == before["llmstack_gateway_time_to_first_token_seconds_count"] + 1
    )  # the stream only
    assert value(admin, "llmstack_gateway_requests_total", status="200", model="other", tenant="acme") >= 1
    assert not any("no-such-model" in str(labels) for _, labels in samples(admin))
    assert value(admin, "llmstack_gateway_in_flight_requests") == 0


def test_idle_and_total_timeouts(redis_server, stream_recording_upstream):  # noqa: F811
    key = new_key(redis_server, max_concurrent_requests=1)  # a slot leaked by a timeout would 429 the next
    idle = settings_for(stream_recording_upstream.url, redis_server.url, upstream_idle_timeout_s=0.5)
    with serving_gateway(idle, RedisKeyStore(redis_server.url)) as (gw, admin):
        silent = httpx.post(
            f"{gw}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}", "x-test-scenario": "silent"},
            json={"model": "tiny", "stream": True, "messages": [{"role": "user", "content": PROMPT}]},
            timeout=30,
        )
        assert silent.status_code == 504 and silent.json()["error"]["code"] == "upstream_timeout"
        llm = client(gw, key)  # its timeout (HANG_BOUND_S) is far above the gateway's 0.5 s
        stream = llm.chat.completions.create(
            model="tiny",
            stream=True,
            messages=[{"role": "user", "content": PROMPT}],
            extra_headers={"x-test-scenario": "stall"},
        )
        assert_cut_not_timed_out(lambda: list(stream))
        assert value(admin, "llmstack_gateway_upstream_errors_total", kind="idle_timeout") == 2
    total = settings_for(stream_recording_upstream.url, redis_server.url, request_timeout_s=1)
    with serving_gateway(total, RedisKeyStore(redis_server.url)) as (gw, admin):
        stream = client(gw, key).chat.completions.create(
            model="tiny",
            stream=True,
            messages=[{"role": "user", "content": PROMPT}],
            extra_headers={"x-test-scenario": "slow"},
        )  # would run for 50 s
        assert_cut_not_timed_out(lambda: list(stream))
        assert value(admin, "llmstack_gateway_upstream_errors_total", kind="total_timeout") == 1
        assert chat_raw(gw, key, max_tokens=5).status_code == 200  # the slot and pool are fine afterwards


def assert_cut_not_timed_out(read) -> None:
    """The gateway cut the stream (the client sees a broken connection, so it knows the answer is
    incomplete): not a clean end, and not the client giving up on its own timeout, which would
    also pass for a gateway that hangs."""
    with pytest.raises(openai.APIConnectionError) as caught:
        read()
    assert not isinstance(caught.value, openai.APITimeoutError)


def test_prompts_are_logged_only_when_the_stack_says_so(redis_server, stream_recording_upstream, caplog):  # noqa: F811
    access = logging.getLogger("llmstack.gateway.access")
    access.disabled = False
    caplog.set_level(logging.INFO, logger="llmstack.gateway.access")
    key = new_key(redis_server)
    for log_prompts in (False, True):
        settings = settings_for(stream_recording_upstream.url, redis_server.url, log_prompts=log_prompts)
        with serving(create_app(settings, RedisKeyStore(redis_server.url))) as gw:
            caplog.clear()
            assert chat_raw(gw, key, max_tokens=5).status_code == 200
        line = next(json.loads(r.getMessage()) for r in caplog.records if '"event": "access"' in r.getMessage())
        assert line["model"] == "tiny" and line["completion_tokens"] == USAGE["completion_tokens"]
        assert (PROMPT in line.get("prompt", "")) is log_prompts
