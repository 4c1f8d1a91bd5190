"""Per-key limits: real redis-server, real gateway apps under uvicorn, a fake
OpenAI upstream, the official openai client where natural.

No test asserts a wall-clock duration. Where the server settles after the client has its
answer (a client that disconnects), tests poll with a deadline that only bounds a hang.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from datetime import datetime, timezone

import httpx
import openai
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ops.devstack.local_redis import redis_server_path, start_redis
from ops.harness.processes import free_port
from ops.harness.stub_upstream import chunk, sse
from serving.gateway.app import create_app
from serving.gateway.key_format import KeyRecord
from serving.gateway.keys import MemoryKeyStore, RedisKeyStore, create_key_sync
from serving.gateway.metering import (
    LimitDecision,
    UsageMeter,
    estimate_prompt_tokens,
    format_reset,
    rate_limit_headers,
    request_usage_upstream,
    reserve_tokens,
)
from tests.serving.gateway.test_app import HANG_BOUND_S, WORDS, client, serving, settings_for

pytestmark = pytest.mark.skipif(redis_server_path() is None, reason="needs redis-server (apt-get install redis-server)")

USAGE = {"prompt_tokens": 5, "completion_tokens": len(WORDS), "total_tokens": 5 + len(WORDS)}
PROMPT = "What is a KV cache?"  # 19 characters: an estimate of 5 tokens
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
                "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens")


class RecordingUpstream:
    """An OpenAI-like upstream that records request bodies, sends the usage chunk only when
    asked (as OpenAI and vLLM do), and can stream slowly forever."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.slow_started = threading.Event()
        self.slow_ended = threading.Event()

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        model = body["model"]
        if not body.get("stream"):
            return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": model, "usage": USAGE,
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": "".join(WORDS)}}]})
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True
        scenario = request.headers.get("x-test-scenario")
        if scenario == "silent":  # never answers: headers never come
            await asyncio.sleep(3600)
        stream = {"slow": self._slow, "stall": self._stall}.get(scenario)
        return StreamingResponse(stream(model) if stream else self._words(model, include_usage),
                                 media_type="text/event-stream")

    async def _words(self, model: str, include_usage: bool):
        yield sse(chunk(model, {"role": "assistant", "content": ""}))
        for word in WORDS:
            yield sse(chunk(model, {"content": word}))
        yield sse(chunk(model, {}, finish="stop"))
        if include_usage:
            yield sse(chunk(model, usage=USAGE))
        yield sse("[DONE]")

    async def _stall(self, model: str):
        yield sse(chunk(model, {"role": "assistant", "content": "one"}))
        await asyncio.sleep(3600)  # then silence

    async def _slow(self, model: str):
        try:
            yield sse(chunk(model, {"role": "assistant", "content": ""}))
            self.slow_started.set()
            for i in range(1000):
                yield sse(chunk(model, {"content": f" tok{i}"}))
                await asyncio.sleep(0.05)
        finally:
            self.slow_ended.set()


@pytest.fixture(scope="module")
def upstream():
    fake = RecordingUpstream()
    with serving(fake.app()) as url:
        fake.url = url
        yield fake


@pytest.fixture(scope="module")
def gateway(redis_server, upstream):
    with serving(create_app(settings_for(upstream.url, redis_server.url), RedisKeyStore(redis_server.url))) as url:
        yield url


def new_key(redis_server, **limits) -> str:
    return create_key_sync(redis_server.url, "acme", "limits", limits=limits)


def chat_raw(gateway: str, key: str, **body) -> httpx.Response:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **body}
    return httpx.post(f"{gateway}/v1/chat/completions", json=payload, headers={"Authorization": f"Bearer {key}"},
                      timeout=HANG_BOUND_S)


def eventually(check, what: str):
    deadline = time.monotonic() + HANG_BOUND_S  # bounds a hang; not a speed assertion
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            assert result, what
            return result
        time.sleep(0.05)


# --- pure helpers --------------------------------------------------------------------------------


def test_prompt_estimate_and_reservation():
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": PROMPT}]}) == 5
    assert estimate_prompt_tokens({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]},
                                                {"role": "system", "content": "x"}]}) == 3
    assert estimate_prompt_tokens({"prompt": ["abcd", "abcd"]}) == 2
    assert estimate_prompt_tokens({"messages": []}) == 1  # at least 1
    doc = {"messages": [{"role": "user", "content": PROMPT}]}
    assert reserve_tokens({**doc, "max_tokens": 100}, "/v1/chat/completions", 4096) == 105
    assert reserve_tokens({**doc, "max_completion_tokens": 10, "n": 3}, "/v1/chat/completions", 4096) == 35
    assert reserve_tokens(doc, "/v1/chat/completions", 4096) == 4101
    assert reserve_tokens({"input": "abcdefgh"}, "/v1/embeddings", 4096) == 2
    assert reserve_tokens(None, "/v1/models", 4096) == 0


def test_reset_format_and_headers():
    assert [format_reset(s) for s in (0.012, 1, 1.5, 360, 3725)] == ["12ms", "1s", "1.5s", "6m0s", "1h2m5s"]
    refused = LimitDecision(allowed=False, refused="requests", limit_requests=20, remaining_requests=0,
                            reset_requests_s=60, limit_tokens=1000, remaining_tokens=900, reset_tokens_s=6,
                            retry_after_s=2.01)
    headers = rate_limit_headers(refused)
    assert headers == {"x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "0",
                       "x-ratelimit-reset-requests": "1m0s", "x-ratelimit-limit-tokens": "1000",
                       "x-ratelimit-remaining-tokens": "900", "x-ratelimit-reset-tokens": "6s", "retry-after": "3"}


def test_usage_meter_strips_usage_chunk_unless_asked():
    body, asked = request_usage_upstream({"model": "tiny", "stream": True})
    assert body["stream_options"] == {"include_usage": True} and not asked
    events = [sse(chunk("tiny", {"content": "a"})), sse(chunk("tiny", usage=USAGE)), sse("[DONE]")]
    raw = b"".join(events)
    for strip in (True, False):
        meter = UsageMeter(stream=True, strip_usage=strip, prompt_estimate=5, reserved=100)
        out = b"".join(meter.feed(raw[i:i + 7]) for i in range(0, len(raw), 7)) + meter.finish()
        assert meter.billed() == USAGE["total_tokens"]
        assert out == (events[0] + events[2] if strip else raw)
    crlf = raw.replace(b"\n\n", b"\r\n\r\n")  # some servers end SSE events with CRLF
    meter = UsageMeter(stream=True, strip_usage=True, prompt_estimate=5, reserved=100)
    out = b"".join(meter.feed(crlf[i:i + 5]) for i in range(0, len(crlf), 5)) + meter.finish()
    assert out == (events[0] + events[2]).replace(b"\n\n", b"\r\n\r\n") and meter.billed() == 13
    cut = UsageMeter(stream=True, strip_usage=True, prompt_estimate=5, reserved=100)
    cut.feed(events[0] + events[0])
    assert cut.billed() == 5 + 2  # no usage arrived: prompt estimate + one token per content chunk


def test_old_key_records_still_load():
    old = '{"key_id": "abc", "tenant": "t", "name": "n", "created_at": "2026-01-01T00:00:00Z"}'
    record = KeyRecord.model_validate_json(old)
    assert record.requests_per_minute is None and record.max_concurrent_requests is None


# --- against Redis -------------------------------------------------------------------------------


def test_exact_admission_under_contention_across_two_gateways(redis_server, upstream):
    n = 20
    key = new_key(redis_server, requests_per_minute=n, max_concurrent_requests=1000, tokens_per_minute=10_000_000)
    settings = settings_for(upstream.url, redis_server.url)
    with serving(create_app(settings, RedisKeyStore(redis_server.url))) as gw1, \
            serving(create_app(settings, RedisKeyStore(redis_server.url))) as gw2:

        async def fire() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=HANG_BOUND_S, limits=httpx.Limits(max_connections=200)) as http:
                payload = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": PROMPT}]}
                return await asyncio.gather(*[
                    http.post(f"{(gw1, gw2)[i % 2]}/v1/chat/completions", json=payload,
                              headers={"Authorization": f"Bearer {key}"}) for i in range(100)])

        clock = redis.Redis.from_url(redis_server.url)
        started = clock.time()
        responses = asyncio.run(fire())
        ended = clock.time()
    # GCRA's allowance over the burst: n at once plus one per 60/n s that passed (by Redis's
    # own clock, the one the script uses). On a quiet machine the burst takes ~1 s: exactly n.
    elapsed = (ended[0] + ended[1] / 1e6) - (started[0] + started[1] / 1e6)
    allowance = n + int(elapsed / (60 / n))
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert n <= len(admitted) <= allowance and len(refused) == 100 - len(admitted)
    for response in responses:
        assert all(name in response.headers for name in RATE_HEADERS)
        assert response.headers["x-ratelimit-limit-requests"] == str(n)
    for response in refused:
        assert int(response.headers["retry-after"]) >= 1
        error = response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"


def test_tokens_are_reserved_then_settled_to_reported_usage(gateway, redis_server):
    key = new_key(redis_server, tokens_per_minute=1000)
    first = chat_raw(gateway, key, max_tokens=900)  # reserves 5 (estimate) + 900
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == "95"  # a fresh bucket: exact
    second = chat_raw(gateway, key, max_tokens=100)  # reserves 105: fits only because of the refund
    assert second.status_code == 200, second.text
    # The first request was settled to its reported usage (13), so at least this much is left;
    # waiting only adds capacity, so this bound holds however long the test took.
    assert int(second.headers["x-ratelimit-remaining-tokens"]) >= 1000 - USAGE["total_tokens"] - 105
    too_big = chat_raw(gateway, key, max_tokens=4000)  # more than the whole per-minute limit, under the ceiling
    assert too_big.status_code == 429 and too_big.json()["error"]["type"] == "tokens"


def test_concurrency_slot_is_released_when_the_client_disconnects(gateway, upstream, redis_server):
    key = new_key(redis_server, max_concurrent_requests=1)
    llm = client(gateway, key)
    upstream.slow_ended.clear()
    stream = llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}], stream=True,
                                         max_tokens=50, extra_headers={"x-test-scenario": "slow"})
    next(iter(stream))
    busy = chat_raw(gateway, key, max_tokens=5)
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "requests"
    assert busy.headers["retry-after"] == "1"
    stream.close()  # disconnect mid-stream
    assert upstream.slow_ended.wait(HANG_BOUND_S)
    eventually(lambda: chat_raw(gateway, key, max_tokens=5).status_code == 200,
               "the slot was not released after the disconnect")


def test_daily_budget_exhausted_is_429_naming_the_budget(gateway, redis_server):
    key = new_key(redis_server, daily_token_budget=50)
    assert chat_raw(gateway, key, max_tokens=20).status_code == 200  # reserves 25, billed 13
    refused = chat_raw(gateway, key, max_tokens=40)  # 13 used + 45 > 50
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "daily_token_budget_exceeded" and "daily token budget" in error["message"]
    now = datetime.now(timezone.utc)
    to_midnight = 86_400 - (now.hour * 3600 + now.minute * 60 + now.second)
    assert abs(int(refused.headers["retry-after"]) - to_midnight) <= 5  # Redis and test clocks agree closely
    with pytest.raises(openai.RateLimitError):
        client(gateway, key).chat.completions.create(model="tiny", max_tokens=40,
                                                     messages=[{"role": "user", "content": PROMPT}])


def test_stream_usage_is_requested_upstream_and_stripped_unless_asked(gateway, upstream, redis_server):
    llm = client(gateway, new_key(redis_server))
    for asked in (False, True):
        extra = {"stream_options": {"include_usage": True}} if asked else {}
        chunks = list(llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": PROMPT}],
                                                  stream=True, **extra))
        assert upstream.bodies[-1]["stream_options"] == {"include_usage": True}
        usage = [c.usage for c in chunks if c.usage is not None]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(WORDS)
        if asked:
            assert usage and usage[-1].total_tokens == USAGE["total_tokens"]
        else:
            assert not usage and all(c.choices for c in chunks)


def test_streamed_response_carries_headers_and_is_settled(gateway, redis_server):
    key = new_key(redis_server, tokens_per_minute=1000)
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "stream": True, "max_tokens": 900,
                            "messages": [{"role": "user", "content": PROMPT}]}, timeout=HANG_BOUND_S) as response:
        assert response.headers["x-ratelimit-remaining-tokens"] == "95"  # set before streaming started
        response.read()
    assert chat_raw(gateway, key, max_tokens=100).status_code == 200  # 905 reserved, 13 billed


def test_two_redis_commands_per_admitted_request(upstream):
    own = start_redis()
    try:
        key = create_key_sync(own.url, "acme", "count")
        with serving(create_app(settings_for(upstream.url, own.url), RedisKeyStore(own.url))) as gw:
            assert chat_raw(gateway=gw, key=key, max_tokens=5).status_code == 200  # loads the scripts
            watcher = redis.Redis.from_url(own.url, decode_responses=True)
            ender = redis.Redis.from_url(own.url)
            ender.ping()  # connect now, so its handshake is not counted
            seen: list[str] = []
            ready = threading.Event()

            def watch() -> None:  # MONITOR: every command a client sends (and, marked "lua", scripts' own)
                with watcher.monitor() as monitor:
                    ready.set()
                    for command in monitor.listen():
                        if "end-of-count" in command["command"]:
                            return
                        if command.get("client_type") != "lua":
                            seen.append(command["command"].split()[0].upper())

            thread = threading.Thread(target=watch, daemon=True)
            thread.start()
            assert ready.wait(HANG_BOUND_S)
            time.sleep(0.2)  # let MONITOR take effect before the counted request (not a speed assertion)
            assert chat_raw(gateway=gw, key=key, max_tokens=5).status_code == 200
            ender.get("end-of-count")
            thread.join(HANG_BOUND_S)
            watcher.close()
            ender.close()
        assert seen == ["GET", "EVALSHA", "EVALSHA"], seen  # key lookup, admit, settle
    finally:
        own.stop()


@pytest.mark.parametrize("mode", ["closed", "local"])
def test_redis_down_fail_modes(upstream, mode):
    own = start_redis()
    try:
        store = MemoryKeyStore()  # keys stay checkable; only the limiter's Redis goes away
        key, _ = asyncio.run(store.create("acme", "failmode", limits={"requests_per_minute": 3}))
        settings = settings_for(upstream.url, own.url, limiter_fail_mode=mode)
        with serving(create_app(settings, store)) as gw:
            own.stop()
            statuses = [chat_raw(gw, key, max_tokens=5) for _ in range(5)]
        if mode == "closed":
            assert all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in statuses)
            assert statuses[0].json()["error"]["code"] == "limiter_unavailable"
        else:  # admitted under this process's own limits: 3 per minute
            assert [r.status_code for r in statuses] == [200, 200, 200, 429, 429]
            assert math.isfinite(int(statuses[-1].headers["retry-after"]))
    finally:
        own.stop()


def test_slot_is_released_when_the_upstream_is_down_and_scripts_reload_after_flush(redis_server):
    key = new_key(redis_server, max_concurrent_requests=1)
    dead = settings_for(f"http://127.0.0.1:{free_port()}", redis_server.url)
    with serving(create_app(dead, RedisKeyStore(redis_server.url))) as gw:
        for _ in range(2):  # a leaked slot would make the second one a 429
            failed = chat_raw(gw, key, max_tokens=5)
            assert failed.status_code == 503 and "x-ratelimit-remaining-requests" in failed.headers
        flusher = redis.Redis.from_url(redis_server.url)
        flusher.script_flush()  # as after a Redis restart: EVALSHA gets NOSCRIPT, redis-py falls back to EVAL
        flusher.close()
        assert chat_raw(gw, key, max_tokens=5).status_code == 503
