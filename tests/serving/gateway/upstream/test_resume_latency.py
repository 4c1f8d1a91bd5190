"""A stream resumed on another replica, as the adaptive capacity times it: through the real gateway
(its relay, its resuming relay and its capacity store) over real HTTP and a real redis-server,
in front of a vLLM-like upstream whose replica dies mid-stream and whose continuation waits
before its first token (tests/support/resumable_upstream.py, `resume_delay`).

The samples are read where every gateway replica merges them: the model's window hashes in
Redis (serving/gateway/capacity/capacity.lua). The break must not be an inter-token gap (one
dying replica would look like an engine far over its latency target and cut the healthy
replicas' capacity), while the continuation's own gaps are."""

from __future__ import annotations

import uuid

import openai
import pytest
import redis

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.capacity.histogram import bucket_of
from serving.gateway.capacity.store import capacity_keys
from tests.support.gateway import GENEROUS
from tests.support.resumable_upstream import ResumableUpstream
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.vllm_upstream import directive, running_gateway
from tests.support.waiting import eventually

MODEL = "tiny"
RESUME_DELAY_S = 1.0  # the break: far longer than any gap between tokens here (20 ms)


@pytest.fixture(scope="module")
def upstream():
    stub = ResumableUpstream()
    with serving(stub) as url:
        stub.url = url
        yield stub


def samples(redis_url: str) -> tuple[dict[int, int], dict[int, int]]:
    """(TTFT, ITL) bucket counts over the model's whole window ring."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ttft: dict[int, int] = {}
    itl: dict[int, int] = {}
    try:
        for key in capacity_keys(MODEL)[2:]:
            for name, count in client.hgetall(key).items():
                if name[0] in "ti" and name[1:].isdigit():
                    into = ttft if name[0] == "t" else itl
                    into[int(name[1:])] = into.get(int(name[1:]), 0) + int(count)
    finally:
        client.close()
    return ttft, itl


def test_the_break_of_a_resumed_stream_is_no_latency_sample_and_its_continuation_is(redis_server, upstream):
    tokens, cut_after = 8, 3
    key = create_key_sync(redis_server.url, f"t-{uuid.uuid4().hex[:8]}", "resume", limits=GENEROUS)
    with running_gateway(
        upstream.url,
        redis_server.url,
        model_context_lengths={MODEL: 4096},
        stream_resume={"enabled": True, "max_resumes": 2},
        model_queues={MODEL: {"max_ongoing_requests": 8}},
        model_capacities={MODEL: {"ttft_ms": 5000, "itl_ms": 5000, "min_slots": 2, "max_slots": 8}},
    ) as gateway:
        api = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        prompt = directive(
            id=uuid.uuid4().hex, tokens=tokens, cut_after=cut_after, interval=0.02, resume_delay=RESUME_DELAY_S
        )
        chunks = list(
            api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=tokens, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).count(" t") == tokens
        # The first stream's role chunk (TTFT) and 3 tokens (3 gaps), then the continuation's
        # 5 tokens: its first after the break, no sample; 4 gaps after it.
        eventually(lambda: sum(samples(redis_server.url)[1].values()) >= 7, "the gateway's samples in Redis")
    ttft, itl = samples(redis_server.url)
    assert sum(ttft.values()) == 1  # the continuation's first token is no second TTFT
    assert sum(itl.values()) == 7
    assert max(itl) < bucket_of(RESUME_DELAY_S * 1000 / 2)  # no gap anywhere near the break
