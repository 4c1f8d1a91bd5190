"""The output bound attacked through HTTP: a key with a valid key's means sends the limit field the
gateway did not read (chat's `max_completion_tokens`, which vLLM reads before `max_tokens`).
Real redis-server, the real gateway under uvicorn, the vLLM-like upstream, which generates up to
the limit vLLM reads from the body (tests/support/vllm_upstream.py); the Batch API's lines too.
What was billed is read from the access lines and the daily counters in Redis; what was
generated, from the upstream's ledger.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.tenants import key_daily_key
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.metering.reservation import prompt_bound
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import daily_used, directive, key_id_of, running_gateway
from tests.support.waiting import eventually

CHAT = "/v1/chat/completions"
CONTEXT_LENGTH = 8192
TEMPLATE_TOKENS = 256


@pytest.fixture(scope="module")
def gateway(redis_server, upstream, tmp_path_factory):
    # A short idle timeout, so that a non-streamed answer the engine is still making gets the 504.
    with running_gateway(
        upstream.url,
        redis_server.url,
        upstream_idle_timeout_s=1.0,
        model_context_lengths={"tiny": CONTEXT_LENGTH},
        batch_storage_url=f"file://{tmp_path_factory.mktemp('batches')}",
        batch={"sweep_interval_s": 0.1, "workers": 4, "lease_s": 2},
    ) as url:
        yield url


def attack_body(rid: str, **fields) -> dict:
    """A chat body whose upstream generates all vLLM lets it: `max_tokens: 1`, and the other field."""
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": directive(id=rid, tokens=10**6)}],
        "max_tokens": 1,
        **fields,
    }


def post(gateway: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{gateway}{CHAT}", json=body, timeout=HANG_BOUND_S, headers={"Authorization": f"Bearer {key}"})


def reservation_of(body: dict) -> int:
    raw = json.dumps(body).encode()  # httpx's json= writes what json.dumps writes
    output = output_bound(body, CHAT, context_length=CONTEXT_LENGTH, ceiling=4096)
    prompt = prompt_bound(body, len(raw), CHAT, context_length=CONTEXT_LENGTH, template_tokens=TEMPLATE_TOKENS)
    return prompt + output.total


def test_four_at_once_cannot_run_past_a_daily_budget(gateway, upstream, redis_server):
    """Four `max_tokens: 1, max_completion_tokens: 4096` at once against a 3,000-token daily budget
    ran it to 16,432. Each now reserves what vLLM may generate: more than the whole budget."""
    key = create_key_sync(redis_server.url, "acme", "budget-4096", limits={"daily_token_budget": 3000})
    bodies = [attack_body(f"day-{i}", max_completion_tokens=4096) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: post(gateway, key, body), bodies))
    assert [a.status_code for a in answers] == [429] * 4
    assert {a.json()["error"]["code"] for a in answers} == {"daily_token_budget_exceeded"}
    assert all(f"day-{i}" not in upstream.generated for i in range(4))  # none reached the engine
    assert daily_used(redis_server.url, key_daily_key("acme", key_id_of(key))) == 0


def test_those_that_fit_are_admitted_only_while_the_budget_lasts(gateway, upstream, redis_server, access_lines):
    """The same with 900: each reserves about 1,300, so two of four fit 3,000; each is billed what
    its engine generated."""
    key = create_key_sync(redis_server.url, "acme", "budget-900", limits={"daily_token_budget": 3000})
    bodies = [attack_body(f"fit-{i}", max_completion_tokens=900) for i in range(4)]
    assert 2 * reservation_of(bodies[0]) <= 3000 < 3 * reservation_of(bodies[0])
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: post(gateway, key, body), bodies))
    assert sorted(a.status_code for a in answers) == [200, 200, 429, 429]
    served = [f"fit-{i}" for i, a in enumerate(answers) if a.status_code == 200]
    generated = sum(upstream.generated[rid]["prompt"] + upstream.generated[rid]["completion"] for rid in served)
    assert all(upstream.generated[rid]["completion"] == 900 for rid in served)
    lines = eventually(
        lambda: len(access_lines.of(key_id_of(key))) == 4 and access_lines.of(key_id_of(key)), "requests still open"
    )
    assert sum(line.get("prompt_tokens", 0) + line.get("completion_tokens", 0) for line in lines) == generated
    assert daily_used(redis_server.url, key_daily_key("acme", key_id_of(key))) == generated <= 3000


def test_a_tokens_per_minute_key_cannot_admit_what_it_cannot_hold(gateway, upstream, redis_server):
    """A 2,000 tokens/min key admitted three `max_completion_tokens: 4096` requests in a row."""
    key = create_key_sync(redis_server.url, "acme", "tpm", limits={"tokens_per_minute": 2000})
    answers = [post(gateway, key, attack_body(f"tpm-{i}", max_completion_tokens=4096)) for i in range(3)]
    assert [a.status_code for a in answers] == [429] * 3
    assert {a.headers.get("x-should-retry") for a in answers} == {"false"}  # it can never fit
    assert all(f"tpm-{i}" not in upstream.generated for i in range(3))


def test_an_answer_that_timed_out_is_billed_what_the_engine_could_have_made(
    gateway, upstream, redis_server, access_lines
):
    """Not streamed: vLLM makes the whole answer before sending a byte, so a 504 (the idle timeout)
    says nothing of what it made. It was billed 1 output token while the engine made 2,040."""
    key = create_key_sync(redis_server.url, "acme", "timeout")
    body = attack_body("slow", max_completion_tokens=2040)
    body["messages"][0]["content"] = directive(id="slow", tokens=10**6, pause_after=0)
    answer = post(gateway, key, body)
    assert answer.status_code == 504
    generated = upstream.generated["slow"]
    assert generated["completion"] == 2040
    line = eventually(lambda: access_lines.of(key_id_of(key)), "no access line")[-1]
    billed = line["prompt_tokens"] + line["completion_tokens"]
    assert generated["prompt"] + generated["completion"] <= billed <= reservation_of(body)
    assert line["completion_tokens"] == 2040  # the reservation's output; its prompt bound, the prompt unknown


def test_batch_lines_with_both_fields_are_bounded_the_same_way(gateway, upstream, redis_server):
    """Batch lines with `max_tokens: 1, max_completion_tokens: 4096` ran a 3,000-token daily budget
    to 8,210: each line is admitted like an online request, with the same bound."""
    key = create_key_sync(redis_server.url, "acme", "batch", limits={"daily_token_budget": 3000})
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": CHAT,
            "body": attack_body(f"batch-{i}", max_completion_tokens=4096),
        }
        for i in range(2)
    ]
    uploaded = client.files.create(
        file=("in.jsonl", "".join(json.dumps(line) + "\n" for line in lines).encode()), purpose="batch"
    )
    # Each line's bound (4,096) is over the 3,000 left, so the batch is refused at create, before
    # any line runs; with max_tokens read first, each line would have reserved 1 and run.
    with pytest.raises(openai.RateLimitError) as refused:
        client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    assert refused.value.code == "daily_token_budget_exceeded"
    assert all(f"batch-{i}" not in upstream.generated for i in range(2))  # no line reached the engine
    assert daily_used(redis_server.url, key_daily_key("acme", key_id_of(key))) == 0
