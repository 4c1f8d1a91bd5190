"""Billing integrity, as a property: whatever mix of requests a tenant's keys send - streamed or
not, one prompt or several, several sequences, multi-token chunks, the output limit as
`max_tokens`, `max_completion_tokens` or both, read whole, cut after some chunks, left at the
headers, answered too slowly - each request is billed exactly what the upstream generated when
its answer went out whole, and between that and its reservation when it was cut; per key and
per tenant, the daily counters hold exactly what was billed.

"Billed" is read where the gateway records it: each request's access line, and the key's and
the tenant's daily counters in Redis. "Generated" is the vLLM-like upstream's own ledger
(tests/support/vllm_upstream.py): prompt tokens once it has read a prompt, each step's tokens
as its engine generates them - at its own pace, ahead of what the client reads, up to the limit
vLLM reads from the body. Real redis-server, the real gateway and proxy under uvicorn,
hypothesis choosing the mix.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.tenants import key_daily_key, tenant_daily_key
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.metering.reservation import prompt_bound
from tests.support.hypothesis import examples
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import daily_used, directive, key_id_of, redis_day, running_gateway
from tests.support.waiting import eventually

CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS = 12
CONTEXT_LENGTH = 4096
TEMPLATE_TOKENS = 256  # GatewayPolicy's default chat_template_tokens

requests = st.fixed_dictionaries(
    {
        "key": st.sampled_from(["a1", "a2", "b1"]),  # tenants: a (two keys), b
        "path": st.sampled_from([CHAT, LEGACY]),
        "stream": st.sampled_from([True, True, False, "true"]),  # "true": refused (vLLM would stream it)
        "n": st.integers(1, 2),
        "prompts": st.integers(1, 2),
        "tokens": st.integers(1, MAX_TOKENS),
        "per_chunk": st.integers(1, 3),  # several tokens in one chunk, as speculative decoding sends them
        # How the chat body states its limit (completions: max_tokens only); "both": vLLM reads max_completion_tokens.
        "limit": st.sampled_from(["max_tokens", "max_completion_tokens", "both"]),
        "ending": st.sampled_from(["whole", "cut", "headers", "slow"]),
        "cut_after": st.integers(1, 4),
        "usage": st.sampled_from(
            [None, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True}]
        ),
    }
)


@pytest.fixture(scope="module")
def gateway(redis_server, upstream):
    # A short idle timeout: an upstream too slow for it (the "slow" ending) is cut by the gateway.
    with running_gateway(
        upstream.url, redis_server.url, upstream_idle_timeout_s=0.5, model_context_lengths={"tiny": CONTEXT_LENGTH}
    ) as url:
        yield url


def document_of(request: dict, rid: str) -> dict:
    steer = {"id": rid, "tokens": MAX_TOKENS * 10, "per_chunk": request["per_chunk"], "interval": 0.001}
    if request["ending"] in ("slow", "headers"):
        steer["pause_after"] = 0
    text = directive(**steer) + "\nWhat is a KV cache?"
    document: dict = {"model": "tiny", "n": request["n"], "stream": request["stream"]}
    if request["path"] == CHAT:
        document["messages"] = [{"role": "user", "content": text}]
        if request["limit"] == "both":  # vLLM generates up to max_completion_tokens, whatever max_tokens says
            document.update(max_tokens=1, max_completion_tokens=request["tokens"])
        else:
            document[request["limit"]] = request["tokens"]
    else:
        document["prompt"] = [text] + ["and again"] * (request["prompts"] - 1) if request["prompts"] > 1 else text
        document["max_tokens"] = request["tokens"]
    if request["usage"] is not None and request["stream"] is True:
        document["stream_options"] = request["usage"]
    return document


def reservation_of(request: dict, body: bytes) -> int:
    document = json.loads(body)
    output = output_bound(document, request["path"], context_length=CONTEXT_LENGTH, ceiling=4096)
    return output.total + prompt_bound(
        document, len(body), request["path"], context_length=CONTEXT_LENGTH, template_tokens=TEMPLATE_TOKENS
    )


def content_events(lines):
    count = 0
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    count += 1
                    yield count


def send(gateway: str, key: str, request: dict, body: bytes) -> bool:
    """Send one request and end it as `request` says: True when its whole answer came back."""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{gateway}{request['path']}"
    try:
        if request["stream"] is not True:  # whole, refused, or a 504
            return httpx.post(url, content=body, headers=headers, timeout=HANG_BOUND_S).status_code == 200
        with httpx.stream("POST", url, content=body, headers=headers, timeout=HANG_BOUND_S) as response:
            if response.status_code != 200 or request["ending"] == "headers":
                return False  # leave at the headers
            if request["ending"] != "cut":
                return response.read().endswith(b"data: [DONE]\n\n")
            for seen in content_events(response.iter_lines()):
                if seen >= request["cut_after"]:
                    return False  # the connection is closed with the rest unread
            return True  # the answer ended before the cut
    except httpx.RemoteProtocolError:
        return False  # the gateway cut the answer (the upstream went silent past its idle timeout)


@settings(
    max_examples=examples(fast=25, deep=200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mix=st.lists(requests, min_size=1, max_size=5))
def test_each_request_is_billed_what_was_generated_and_never_more_than_it_reserved(
    gateway, upstream, redis_server, access_lines, mix
):
    run = uuid.uuid4().hex[:8]
    tenants = {"a": f"tenant-a-{run}", "b": f"tenant-b-{run}"}
    keys = {
        name: create_key_sync(
            redis_server.url,
            tenants[name[0]],
            name,
            limits={"requests_per_minute": 10_000, "tokens_per_minute": 10_000_000, "max_concurrent_requests": 100},
        )
        for name in ("a1", "a2", "b1")
    }
    day = redis_day(redis_server.url)
    billed_by_key = dict.fromkeys(keys, 0)
    for request in mix:
        rid = uuid.uuid4().hex
        body = json.dumps(document_of(request, rid)).encode()
        key_id = key_id_of(keys[request["key"]])
        ended = len(access_lines.of(key_id))
        whole = send(gateway, keys[request["key"]], request, body)
        # One request at a time: its access line is written once it has ended (and settled).
        line = eventually(lambda k=key_id, n=ended: access_lines.of(k)[n:], "the request never ended")[0]
        billed = line.get("prompt_tokens", 0) + line.get("completion_tokens", 0)
        eventually(
            lambda r=rid: (
                request["stream"] is not True or whole or r not in upstream.generated or r in upstream.stopped
            ),
            "the engine never stopped",
        )
        used = upstream.generated.get(rid, {"prompt": 0, "completion": 0})
        generated = used["prompt"] + used["completion"]
        if whole:
            assert billed == generated, (request, line, used)
        else:
            assert generated <= billed <= reservation_of(request, body), (request, line, used)
        billed_by_key[request["key"]] += billed
    assume(redis_day(redis_server.url) == day)  # a UTC midnight in between starts new daily counters
    for tenant in ("a", "b"):
        names = [name for name in keys if name.startswith(tenant)]
        for name in names:
            counted = daily_used(redis_server.url, key_daily_key(tenants[tenant], key_id_of(keys[name])))
            assert counted == billed_by_key[name]  # the limiter's counter holds exactly what was billed
        assert daily_used(redis_server.url, tenant_daily_key(tenants[tenant])) == sum(
            billed_by_key[name] for name in names
        )
