"""A stream whose replica dies mid-answer is resumed by the gateway: through the real gateway over
real HTTP, the official openai client reading, real redis-server, and a vLLM-like upstream that
aborts its connection after some chunks (no [DONE]) and answers the token-id continuations
(tests/support/resumable_upstream.py).

What the client must see: one whole stream (one id, one role chunk, the text of the uncut
answer), the usage of the whole answer, billed once (the key's and the tenant's daily counters
hold the prompt once and every output token once). The attacks: a client that leaves mid-stream
never gets a continuation sent upstream; a continuation never asks for more than the original
request had left; past max_resumes the client gets an error (the openai client raises), never a
stream that just stops.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.tenants import key_daily_key, tenant_daily_key
from serving.gateway.limits.usage_ledger import DailyUsage, parse_usage_hash, usage_key
from tests.support.resumable_upstream import PROMPT_TOKENS, ResumableUpstream, answer_text
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.vllm_upstream import daily_used, directive, key_id_of, running_gateway

MAX_RESUMES = 2


@pytest.fixture(scope="module")
def upstream():
    stub = ResumableUpstream()
    with serving(stub) as url:
        stub.url = url
        yield stub


@pytest.fixture(scope="module")
def gateway(redis_server, upstream):
    with running_gateway(
        upstream.url,
        redis_server.url,
        model_context_lengths={"tiny": 4096},
        stream_resume={"enabled": True, "max_resumes": MAX_RESUMES},
    ) as url:
        yield url


@pytest.fixture
def tenant_key(redis_server):
    tenant = f"tenant-{uuid.uuid4().hex[:8]}"
    key = create_key_sync(
        redis_server.url,
        tenant,
        "resume",
        limits={"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000, "max_concurrent_requests": 10},
    )
    return tenant, key


def ledger(redis_url: str, tenant: str) -> list[DailyUsage]:
    """The tenant's usage ledger rows of today (UTC)."""
    today = datetime.now(UTC).date()
    with redis.Redis.from_url(redis_url, decode_responses=True) as connection:
        return parse_usage_hash(tenant, today, connection.hgetall(usage_key(tenant, today)))


def client(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)


def stream_with_usage(api: openai.OpenAI, route: str, prompt: str, tokens: int) -> tuple[list, str]:
    """`prompt` streamed to the end on `route` ("chat" or "completions") with the usage chunk
    asked for: every chunk read, and the answer's text."""
    options = {"max_tokens": tokens, "stream": True, "stream_options": {"include_usage": True}}
    if route == "chat":
        messages = [{"role": "user", "content": prompt}]
        chunks = list(api.chat.completions.create(model="tiny", messages=messages, **options))
        return chunks, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chunks = list(api.completions.create(model="tiny", prompt=prompt, **options))
    return chunks, "".join(c.choices[0].text for c in chunks if c.choices)


def billed(redis_url: str, tenant: str, key: str) -> tuple[int, int]:
    return (
        daily_used(redis_url, key_daily_key(tenant, key_id_of(key))),
        daily_used(redis_url, tenant_daily_key(tenant)),
    )


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("cut_after", [1, 3, 6])
def test_a_stream_cut_by_its_replica_reads_as_one_whole_answer_billed_once(
    gateway, upstream, redis_server, tenant_key, route, cut_after
):
    tenant, key = tenant_key
    tokens, rid = 8, uuid.uuid4().hex
    prompt = directive(id=rid, tokens=tokens, cut_after=cut_after) + "\nWhat is a KV cache?"
    chunks, text = stream_with_usage(client(gateway, key), route, prompt, tokens)
    ids, created = {c.id for c in chunks}, {c.created for c in chunks}
    assert len(ids) == 1 and len(created) == 1, "every chunk keeps the original stream's id and created"
    with_choices = [c for c in chunks if c.choices]
    assert all(choice.index == 0 for c in with_choices for choice in c.choices)
    if route == "chat":
        roles = [c for c in with_choices if c.choices[0].delta.role is not None]
        assert len(roles) == 1, "no second role chunk"
    assert text == answer_text(tokens)
    assert [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert (usage.prompt_tokens, usage.completion_tokens) == (PROMPT_TOKENS, tokens)
    # One continuation, from where the client's text stopped, and billed once.
    continuations = [body for body in upstream.continuations() if body["prompt"][0] == upstream.requests_of(rid)]
    assert len(continuations) == 1
    assert continuations[0]["max_tokens"] == tokens - cut_after
    assert "token_ids" not in str([c.model_dump() for c in chunks]), "ids the client did not ask for stay here"
    expected = PROMPT_TOKENS + tokens
    assert upstream.generated[rid]["completion"] == tokens  # the engine generated each token once, too
    assert billed(redis_server.url, tenant, key) == (expected, expected)
    # The ledger bills the tenant the answer; the continuation's re-read prompt and answer so far
    # is recorded beside it as the platform's overhead (llmctl cost's overhead line).
    [row] = ledger(redis_server.url, tenant)
    assert (row.prompt_tokens, row.completion_tokens, row.requests) == (PROMPT_TOKENS, tokens, 1)
    assert (row.overhead_prompt_tokens, row.overhead_completion_tokens) == (PROMPT_TOKENS + cut_after, 0)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_whose_engine_stops_under_it_is_resumed_not_ended_with_an_error(
    gateway, upstream, redis_server, tenant_key, route
):
    """A replica whose graceful shutdown ran out stops its engine under the streams it still has:
    vLLM ends each with a 500 error event and [DONE]. That is a lost replica, not the answer."""
    tenant, key = tenant_key
    tokens, rid = 8, uuid.uuid4().hex
    prompt = directive(id=rid, tokens=tokens, cut_after=3, engine_error=True) + "\nWhat is a KV cache?"
    chunks, text = stream_with_usage(client(gateway, key), route, prompt, tokens)
    assert text == answer_text(tokens) and len({c.id for c in chunks}) == 1
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (PROMPT_TOKENS, tokens)
    continuations = [body for body in upstream.continuations() if body["prompt"][0] == upstream.requests_of(rid)]
    assert len(continuations) == 1 and continuations[0]["max_tokens"] == tokens - 3
    expected = PROMPT_TOKENS + tokens
    assert billed(redis_server.url, tenant, key) == (expected, expected)


def test_an_error_event_of_the_request_itself_is_its_answer_never_resumed(gateway, upstream, tenant_key):
    _, key = tenant_key
    rid = uuid.uuid4().hex
    prompt = directive(id=rid, tokens=8, cut_after=2, engine_error=True, error_code=400) + "\nWhat is a KV cache?"
    with pytest.raises(openai.APIError):
        list(client(gateway, key).completions.create(model="tiny", prompt=prompt, max_tokens=8, stream=True))
    assert [body for body in upstream.continuations() if body["prompt"][0] == upstream.requests_of(rid)] == []


def test_a_client_that_leaves_mid_stream_never_gets_a_continuation(gateway, upstream, redis_server, tenant_key):
    tenant, key = tenant_key
    rid = uuid.uuid4().hex
    prompt = directive(id=rid, tokens=40, cut_after=20, interval=0.02) + "\nWhat is a KV cache?"
    with httpx.stream(
        "POST",
        f"{gateway}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "prompt": prompt, "max_tokens": 40, "stream": True},
        timeout=HANG_BOUND_S,
    ) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: {")
            if seen == 2:
                break  # the client closes its connection here
    # Its upstream stream is closed (and would have died at chunk 20): wait past that point.
    time.sleep(40 * 0.02 + 0.5)
    number = upstream.requests_of(rid)
    assert [body for body in upstream.continuations() if body["prompt"][0] == number] == []
    assert upstream.generated[rid]["completion"] <= 20  # the replica went on to its death, after the client left


def test_past_max_resumes_the_client_gets_an_error_never_a_silent_cut(gateway, upstream, redis_server, tenant_key):
    tenant, key = tenant_key
    rid, tokens = uuid.uuid4().hex, 12
    prompt = directive(id=rid, tokens=tokens, cut_after=2, cuts=MAX_RESUMES + 1) + "\nWhat is a KV cache?"
    stream = client(gateway, key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=tokens, stream=True
    )
    text = ""
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
    assert "interrupted" in str(raised.value.message)
    # Each of the three streams got 2 tokens out before dying: the client has them, in order.
    assert text == answer_text(2 * (MAX_RESUMES + 1))
    continuations = [b for b in upstream.continuations() if b["prompt"][0] == upstream.requests_of(rid)]
    assert len(continuations) == MAX_RESUMES
    # Each continuation asks for what the original request had left, never more (nor less).
    assert [b["max_tokens"] for b in continuations] == [tokens - 2 * k for k in range(1, MAX_RESUMES + 1)]


def sample(gateway, name: str, **labels: str) -> float:
    text = httpx.get(f"{gateway.metrics}/metrics", timeout=HANG_BOUND_S).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_resumes_their_gap_their_overhead_and_failures_are_counted(gateway, upstream, tenant_key):
    _, key = tenant_key
    resumed = ("llmstack_gateway_stream_resumes_total", {"model": "tiny", "reason": "connection_reset"})
    failed = ("llmstack_gateway_stream_resume_failures_total", {"model": "tiny", "reason": "connection_reset"})
    gaps = ("llmstack_gateway_stream_resume_gap_seconds_count", {"model": "tiny"})
    prefill = ("llmstack_gateway_stream_resume_overhead_tokens_total", {"model": "tiny", "kind": "prompt"})
    names = (resumed, failed, gaps, prefill)
    before = [sample(gateway, name, **labels) for name, labels in names]
    api = client(gateway, key)
    prompt = directive(id=uuid.uuid4().hex, tokens=6, cut_after=2) + "\nWhat is a KV cache?"
    list(api.completions.create(model="tiny", prompt=prompt, max_tokens=6, stream=True))
    after = [sample(gateway, name, **labels) for name, labels in names]
    # One resume, its gap, no failure; the continuation re-read the prompt and the 2 tokens the client had.
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 0, 1, PROMPT_TOKENS + 2]
    prompt = directive(id=uuid.uuid4().hex, tokens=12, cut_after=1, cuts=MAX_RESUMES + 1) + "\nAgain?"
    with pytest.raises(openai.APIError):
        list(api.completions.create(model="tiny", prompt=prompt, max_tokens=12, stream=True))
    last = [sample(gateway, name, **labels) for name, labels in names]
    assert [a - b for a, b in zip(last[:2], after[:2], strict=True)] == [MAX_RESUMES, 1]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_whole_answer_lost_with_its_replica_is_asked_once_more_and_billed_once(
    gateway, upstream, redis_server, tenant_key, route
):
    tenant, key = tenant_key
    rid, tokens = uuid.uuid4().hex, 6
    prompt = directive(id=rid, tokens=tokens, cut_after=0) + "\nWhat is a KV cache?"
    api = client(gateway, key)
    if route == "chat":
        answer = api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=tokens
        )
        text = answer.choices[0].message.content
    else:
        answer = api.completions.create(model="tiny", prompt=prompt, max_tokens=tokens)
        text = answer.choices[0].text
    assert text == answer_text(tokens)
    assert len([p for p, body in upstream.requests if rid in str(body)]) == 2  # the lost one, then once more
    expected = PROMPT_TOKENS + tokens
    assert billed(redis_server.url, tenant, key) == (expected, expected)  # the answer it got, once


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_stream_whose_replica_dies_in_its_prefill_is_asked_once_more_and_billed_once(
    gateway, upstream, redis_server, tenant_key, route
):
    """Before its first chunk a stream has no response headers yet (Ray Serve LLM's ingress peeks
    at the first chunk), so a replica lost in the prefill is HAProxy's 502, not a broken stream."""
    tenant, key = tenant_key
    rid, tokens = uuid.uuid4().hex, 6
    prompt = directive(id=rid, tokens=tokens, cut_after=0, in_prefill=True) + "\nWhat is a KV cache?"
    chunks, text = stream_with_usage(client(gateway, key), route, prompt, tokens)
    assert text == answer_text(tokens)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == tokens
    assert len([p for p, body in upstream.requests if rid in str(body)]) == 2  # the lost one, then once more
    expected = PROMPT_TOKENS + tokens
    assert billed(redis_server.url, tenant, key) == (expected, expected)


def test_a_whole_answer_is_asked_once_more_only_once(gateway, upstream, redis_server, tenant_key):
    tenant, key = tenant_key
    rid = uuid.uuid4().hex
    prompt = directive(id=rid, tokens=6, cut_after=0, cuts=2) + "\nWhat is a KV cache?"
    with pytest.raises(openai.APIStatusError) as raised:
        client(gateway, key).completions.create(model="tiny", prompt=prompt, max_tokens=6)
    assert raised.value.status_code >= 500
    assert len([p for p, body in upstream.requests if rid in str(body)]) == 2
    assert billed(redis_server.url, tenant, key) == (0, 0)
