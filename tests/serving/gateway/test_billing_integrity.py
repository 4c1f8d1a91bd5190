"""Billing integrity, as a property: whatever mix of requests a tenant's keys send - streamed or
not, one prompt or several, several sequences, multi-token chunks, read whole, cut after some
chunks, left at the headers, answered too slowly - the gateway never bills less than the
upstream generated, per key and per tenant.

"Billed" is read where the gateway records it: each request's access line, and the key's and
the tenant's daily counters in Redis. "Generated" is the vLLM-like upstream's own ledger (see
conftest): prompt tokens once it has read a prompt, each chunk's tokens before the chunk is
sent. Real redis-server, the real gateway and proxy under uvicorn, hypothesis choosing the mix.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from serving.gateway.keys import create_key_sync
from serving.gateway.tenants import key_daily_key, tenant_daily_key
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import daily_used, directive, eventually, key_id_of, redis_day, running_gateway

CHAT, LEGACY = "/v1/chat/completions", "/v1/completions"
MAX_TOKENS = 12

requests = st.fixed_dictionaries({
    "key": st.sampled_from(["a1", "a2", "b1"]),  # tenants: a (two keys), b
    "path": st.sampled_from([CHAT, LEGACY]),
    "stream": st.sampled_from([True, True, False, "true"]),  # "true": refused (vLLM would stream it)
    "n": st.integers(1, 2),
    "prompts": st.integers(1, 2),
    "tokens": st.integers(1, MAX_TOKENS),
    "per_chunk": st.integers(1, 3),  # several tokens in one chunk, as speculative decoding sends them
    "ending": st.sampled_from(["whole", "cut", "headers", "slow"]),
    "cut_after": st.integers(1, 4),
    "usage": st.sampled_from([None, {"include_usage": True},
                              {"include_usage": True, "continuous_usage_stats": True}]),
})


@pytest.fixture(scope="module")
def gateway(redis_server, upstream):
    # A short idle timeout: an upstream too slow for it (the "slow" ending) is cut by the gateway.
    with running_gateway(upstream.url, redis_server.url, upstream_idle_timeout_s=0.5,
                         model_context_lengths={"tiny": 4096}) as url:
        yield url


def body_of(request: dict, rid: str) -> bytes:
    steer = {"id": rid, "tokens": request["tokens"], "per_chunk": request["per_chunk"]}
    if request["ending"] in ("cut", "slow"):
        steer["pause_after"] = request["cut_after"] if request["stream"] is True and request["ending"] == "cut" else 0
    if request["ending"] == "headers":
        steer["pause_after"] = 0
    text = directive(**steer) + "\nWhat is a KV cache?"
    document: dict = {"model": "tiny", "max_tokens": MAX_TOKENS, "n": request["n"], "stream": request["stream"]}
    if request["path"] == CHAT:
        document["messages"] = [{"role": "user", "content": text}]
    else:
        document["prompt"] = [text] + ["and again"] * (request["prompts"] - 1) if request["prompts"] > 1 else text
    if request["usage"] is not None and request["stream"] is True:
        document["stream_options"] = request["usage"]
    return json.dumps(document).encode()


def content_events(lines) -> int:
    count = 0
    for line in lines:
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    count += 1
                    yield count


def send(gateway: str, key: str, request: dict, body: bytes) -> None:
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    url = f"{gateway}{request['path']}"
    try:
        if request["stream"] is not True:
            httpx.post(url, content=body, headers=headers, timeout=HANG_BOUND_S)  # whole, refused, or a 504
            return
        with httpx.stream("POST", url, content=body, headers=headers, timeout=HANG_BOUND_S) as response:
            if response.status_code != 200 or request["ending"] == "headers":
                return  # leave at the headers
            if request["ending"] != "cut":
                response.read()
                return
            for seen in content_events(response.iter_lines()):
                if seen >= request["cut_after"]:
                    return  # the connection is closed with the rest unread
    except httpx.RemoteProtocolError:
        pass  # the gateway cut the answer (the upstream went silent past its idle timeout)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(mix=st.lists(requests, min_size=1, max_size=5))
def test_billed_is_never_less_than_generated_per_key_and_tenant(gateway, upstream, redis_server, access_lines, mix):
    run = uuid.uuid4().hex[:8]
    tenants = {"a": f"tenant-a-{run}", "b": f"tenant-b-{run}"}
    keys = {name: create_key_sync(redis_server.url, tenants[name[0]], name, limits={
        "requests_per_minute": 10_000, "tokens_per_minute": 10_000_000, "max_concurrent_requests": 100})
        for name in ("a1", "a2", "b1")}
    day = redis_day(redis_server.url)
    sent: dict[str, list[str]] = {name: [] for name in keys}
    for request in mix:
        rid = uuid.uuid4().hex
        sent[request["key"]].append(rid)
        send(gateway, keys[request["key"]], request, body_of(request, rid))
    for name, rids in sent.items():  # every request has ended (and settled) once its access line is written
        key_id, count = key_id_of(keys[name]), len(rids)
        eventually(lambda k=key_id, n=count: len(access_lines.of(k)) == n, f"{name}: requests still open")
    assume(redis_day(redis_server.url) == day)  # a UTC midnight in between starts new daily counters

    def generated(rids: list[str]) -> int:
        return sum(upstream.generated[rid]["prompt"] + upstream.generated[rid]["completion"]
                   for rid in rids if rid in upstream.generated)

    for tenant in ("a", "b"):
        names = [name for name in keys if name.startswith(tenant)]
        tenant_billed = 0
        for name in names:
            lines = access_lines.of(key_id_of(keys[name]))
            billed = sum(line.get("prompt_tokens", 0) + line.get("completion_tokens", 0) for line in lines)
            counted = daily_used(redis_server.url, key_daily_key(tenants[tenant], key_id_of(keys[name])))
            assert billed >= generated(sent[name]), (name, lines, [upstream.generated.get(r) for r in sent[name]])
            assert counted == billed  # the limiter's counter holds exactly what the access lines billed
            tenant_billed += billed
        tenant_generated = sum(generated(sent[name]) for name in names)
        assert tenant_billed >= tenant_generated
        assert daily_used(redis_server.url, tenant_daily_key(tenants[tenant])) == tenant_billed
