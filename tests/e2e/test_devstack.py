"""End to end: `python -m ops.devstack` (what `make dev` runs) with a real redis-server, Ray Serve,
CPU vLLM and the gateway, called with the official `openai` client.

The stack is the session's shared one (tests/e2e/conftest.py); its teardown stops it and
checks that nothing it started is left running.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest

from infra.spec.stack_file import PROJECT_ROOT
from ops.harness.processes import free_port

ROOT = PROJECT_ROOT
pytestmark = pytest.mark.slow


def test_lists_every_model(dev_client, dev_stack):
    assert sorted(m.id for m in dev_client.models.list()) == sorted(dev_stack.ready["models"])


def test_serve_lists_every_model_at_its_root_and_serves_each_under_its_prefix(dev_stack):
    """Direct serving path: one Serve application per model, plus the list at `/`."""
    listed = httpx.get(f"{dev_stack.ready['serve_url']}/models", timeout=30).json()
    assert sorted(m["id"] for m in listed["data"]) == sorted(dev_stack.ready["models"])
    for model, url in dev_stack.ready["model_urls"].items():
        assert [m["id"] for m in httpx.get(f"{url}/models", timeout=30).json()["data"]] == [model]
    assert (
        httpx.post(
            f"{dev_stack.ready['serve_url']}/chat/completions", timeout=30, json={"model": "tiny-chat", "messages": []}
        ).status_code
        == 404
    )


def test_a_repeated_prompt_is_served_from_the_prefix_cache(dev_client):
    long_prompt = " ".join(["the KV cache keeps every token of a conversation"] * 20)  # two 128-token blocks and more
    usages = [
        dev_client.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": long_prompt}], max_tokens=2
        ).usage
        for _ in range(2)
    ]
    assert usages[1].prompt_tokens_details.cached_tokens >= 128


def test_chat_completion(dev_client):
    reply = dev_client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].message.content
    assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 0


def test_rate_limit_headers_come_with_every_answer(dev_client):
    raw = dev_client.chat.completions.with_raw_response.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert raw.headers["x-ratelimit-limit-requests"] == "6000"  # Pulumi.local.yaml's default_limits
    assert int(raw.headers["x-ratelimit-remaining-tokens"]) < 10_000_000
    assert raw.parse().usage.completion_tokens <= 4


def test_two_models_side_by_side_including_speculative(dev_client):
    for model in ("tiny-chat", "tiny-chat-ngram"):
        reply = dev_client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hi hi hi"}],
            max_tokens=6,
            extra_body={"ignore_eos": True},
        )
        assert reply.model == model and reply.usage.completion_tokens == 6


def test_streamed_chat_usage_is_right(dev_client):
    stream = dev_client.chat.completions.create(
        model="tiny-chat",
        messages=[{"role": "user", "content": "Tell me"}],
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def _network_reads(url: str, headers: dict[str, str]) -> int:
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Go"}],
        "max_tokens": 256,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{url}/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            return sum(1 for chunk in response.iter_raw() if chunk)


def test_stream_arrives_incrementally_not_buffered(dev_stack):
    """Count the separate network reads that carry the body. Ray Serve LLM flushes stream
    chunks every 50 ms (`stream_batching_interval_ms`), so 256 tokens arrive in several reads
    when nothing buffers; a buffering gateway would deliver them in one or two."""
    through_gateway = _network_reads(
        dev_stack.ready["base_url"], {"Authorization": f"Bearer {dev_stack.ready['api_key']}"}
    )
    assert through_gateway >= 4, f"stream arrived in {through_gateway} reads"


def test_legacy_completion(dev_client):
    reply = dev_client.completions.create(
        model="tiny-chat", prompt="Once upon", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].text and reply.usage.completion_tokens == 5


def test_wrong_key_gets_openai_401(dev_stack):
    bad = openai.OpenAI(base_url=dev_stack.ready["base_url"], api_key="sk-llm-wrong_key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401
    assert info.value.body["message"] and info.value.body["type"]  # the client unwraps {"error": {...}}


def test_missing_key_gets_openai_401(dev_stack):
    response = httpx.get(f"{dev_stack.ready['base_url']}/models", timeout=30)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["message"] and error["type"] and "code" in error


def test_a_batch_runs_through_the_real_model_each_custom_id_once(dev_client):
    """The Batch API on make dev: the official client uploads, creates, polls and downloads; every
    line is answered by the engine (through the gateway's admission at the batch tier)."""
    import json
    import time

    lines = [
        {
            "custom_id": f"e2e-{n}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": f"Count to {n}"}], "max_tokens": 4},
        }
        for n in range(12)
    ]
    lines.append(
        {
            "custom_id": "e2e-refused",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny-chat", "messages": [], "stream": True},
        }
    )
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = dev_client.files.create(file=("e2e.jsonl", content), purpose="batch")
    batch = dev_client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 300
    while (batch := dev_client.batches.retrieve(batch.id)).status not in ("completed", "failed", "expired"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
    assert batch.status == "completed" and batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (12, 1)
    output = [json.loads(x) for x in dev_client.files.content(batch.output_file_id).text.splitlines()]
    assert [line["custom_id"] for line in output] == [f"e2e-{n}" for n in range(12)]
    for line in output:
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and 0 < body["usage"]["completion_tokens"] <= 4
    [refused] = [json.loads(x) for x in dev_client.files.content(batch.error_file_id).text.splitlines()]
    assert refused["custom_id"] == "e2e-refused" and refused["response"]["status_code"] == 400


def test_second_dev_says_already_running(dev_stack):
    second = subprocess.run(
        [sys.executable, "-m", "ops.devstack", "--stack", "local", "--port", str(free_port())],
        cwd=ROOT,
        env=dev_stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 1
    assert "already running" in second.stderr and str(dev_stack.process.pid) in second.stderr
