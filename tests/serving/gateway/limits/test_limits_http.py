"""Per-key limits: real redis-server, real gateway apps under uvicorn, a fake
OpenAI upstream, the official openai client where natural.

No test asserts a wall-clock duration. Where the server settles after the client has its
answer (a client that disconnects), tests poll with a deadline that only bounds a hang.
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import httpx
import openai
import pytest
import redis

from ops.devstack.local_redis import start_redis
from ops.harness.processes import free_port
from ops.harness.stub_upstream import chunk, sse
from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.auth.keys import MemoryKeyStore, RedisKeyStore, create_key_sync
from serving.gateway.http.app import create_app
from serving.gateway.limits.decision import LimitDecision, format_reset, rate_limit_headers
from serving.gateway.limits.tenants import counter_keys
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.metering.reservation import Reservation, reserve
from serving.gateway.metering.usage_meter import UsageMeter, request_usage_upstream
from tests.support.openai_fakes import (
    PROMPT,
    RATE_HEADERS,
    TEMPLATE_TOKENS,
    WORDS,
    chat_payload,
    chat_raw,
    client,
    new_key,
    settings_for,
)
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.vllm_upstream import serving_apps
from tests.support.waiting import eventually

USAGE = {"prompt_tokens": 5, "completion_tokens": len(WORDS), "total_tokens": 5 + len(WORDS)}


@pytest.fixture(scope="module")
def limits_gateway(redis_server, stream_recording_upstream):
    settings = settings_for(stream_recording_upstream.url, redis_server.url)
    with serving_apps(settings, RedisKeyStore(redis_server.url)) as url:
        yield url


def reserved_for(payload: bytes) -> int:
    """A one-message chat body's reservation, by hand: its bytes, 4 tokens per JSON value (the
    root, each top-level field, the message list, the message, its role and content), the chat
    template's allowance, and max_tokens (this module's requests all set it)."""
    fields = json.loads(payload)
    return len(payload) + 4 * (len(fields) + 4) + TEMPLATE_TOKENS + fields["max_tokens"]


def max_tokens_reserving(total: int, **body) -> int:
    """The max_tokens that makes a chat_payload reserve exactly `total` tokens."""
    for digits in range(1, 7):
        guess = total - reserved_for(chat_payload(max_tokens=10 ** (digits - 1), **body)) + 10 ** (digits - 1)
        if guess > 0 and len(str(guess)) == digits and reserved_for(chat_payload(max_tokens=guess, **body)) == total:
            return guess
    raise AssertionError(f"no max_tokens reserves {total}")


def key_id_of(key: str) -> str:
    return key.removeprefix("sk-llm-").split("_", 1)[0]


def redis_clock(url: str) -> float:
    client = redis.Redis.from_url(url)
    try:
        seconds, micros = client.time()
        return seconds + micros / 1e6
    finally:
        client.close()


def counter(url: str, key: str, which: int) -> str | None:
    """One of the key's limiter entries in Redis (tenants.counter_keys order: 0 request TAT,
    1 token TAT, 2 in-flight slots, 3 daily usage) as a plain value."""
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        name = counter_keys("acme", key_id_of(key))[which]
        kind = client.type(name)
        if kind == "zset":
            return str(client.zcard(name))
        if kind == "hash":
            return client.hget(name, "used")
        return client.get(name)
    finally:
        client.close()


# --- pure helpers --------------------------------------------------------------------------------


def test_reservation_of_this_modules_requests():
    payload = chat_payload(max_tokens=100)
    assert reserved_for(payload) == len(payload) + 4 * 7 + 256 + 100
    document = json.loads(payload)
    output = output_bound(document, "/v1/chat/completions", context_length=None, ceiling=4096)
    assert reserve(
        document, len(payload), "/v1/chat/completions", output=output, context_length=None, template_tokens=256
    ).total == reserved_for(payload)
    assert reserved_for(chat_payload(max_tokens=max_tokens_reserving(905))) == 905


def test_reset_format_and_headers():
    assert [format_reset(s) for s in (0.012, 1, 1.5, 360, 3725)] == ["12ms", "1s", "1.5s", "6m0s", "1h2m5s"]
    refused = LimitDecision(
        allowed=False,
        refused="requests",
        limit_requests=20,
        remaining_requests=0,
        reset_requests_s=60,
        limit_tokens=1000,
        remaining_tokens=900,
        reset_tokens_s=6,
        retry_after_s=2.01,
    )
    headers = rate_limit_headers(refused)
    assert headers == {
        "x-ratelimit-limit-requests": "20",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "900",
        "x-ratelimit-reset-tokens": "6s",
        "retry-after": "3",
    }


def test_usage_meter_strips_usage_chunk_unless_asked():
    body = request_usage_upstream({"model": "tiny", "stream": True})
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    events = [sse(chunk("tiny", {"content": "a"})), sse(chunk("tiny", usage=USAGE)), sse("[DONE]")]
    raw = b"".join(events)
    reservation = Reservation(prompt=5, output=95)
    for strip in (True, False):
        meter = UsageMeter(stream=True, reservation=reservation, client_final_usage=not strip)
        out = b"".join(meter.feed(raw[i : i + 7]) for i in range(0, len(raw), 7)) + meter.finish()
        assert meter.billed() == USAGE["total_tokens"]
        assert out == (events[0] + events[2] if strip else raw)
    crlf = raw.replace(b"\n\n", b"\r\n\r\n")  # some servers end SSE events with CRLF
    meter = UsageMeter(stream=True, reservation=reservation, client_final_usage=False)
    out = b"".join(meter.feed(crlf[i : i + 5]) for i in range(0, len(crlf), 5)) + meter.finish()
    assert out == (events[0] + events[2]).replace(b"\n\n", b"\r\n\r\n") and meter.billed() == 13
    cut = UsageMeter(stream=True, reservation=reservation, client_final_usage=False)
    cut.feed(events[0] + events[0])
    assert cut.billed() == 100  # no usage arrived: the reservation, never a count of chunks


def test_old_key_records_still_load():
    old = '{"key_id": "abc", "tenant": "t", "name": "n", "created_at": "2026-01-01T00:00:00Z"}'
    record = KeyRecord.model_validate_json(old)
    assert record.requests_per_minute is None and record.max_concurrent_requests is None


# --- against Redis -------------------------------------------------------------------------------


def test_exact_admission_under_contention_across_two_gateways(redis_server, stream_recording_upstream):
    n = 20
    key = new_key(redis_server, requests_per_minute=n, max_concurrent_requests=1000, tokens_per_minute=10_000_000)
    settings = settings_for(stream_recording_upstream.url, redis_server.url)
    with (
        serving(create_app(settings, RedisKeyStore(redis_server.url))) as gw1,
        serving(create_app(settings, RedisKeyStore(redis_server.url))) as gw2,
    ):

        async def fire() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=HANG_BOUND_S, limits=httpx.Limits(max_connections=200)) as http:
                payload = {"model": "tiny", "max_tokens": 10, "messages": [{"role": "user", "content": PROMPT}]}
                return await asyncio.gather(
                    *[
                        http.post(
                            f"{(gw1, gw2)[i % 2]}/v1/chat/completions",
                            json=payload,
                            headers={"Authorization": f"Bearer {key}"},
                        )
                        for i in range(100)
                    ]
                )

        started = redis_clock(redis_server.url)
        responses = asyncio.run(fire())
        ended = redis_clock(redis_server.url)
        last_tat = int(counter(redis_server.url, key, 0)) / 1e6  # the request TAT the burst left
    # GCRA's allowance over the burst: n at once plus one per 60/n s that passed (by Redis's
    # own clock, the one the script uses). On a quiet machine the burst takes ~1 s: exactly n.
    elapsed = ended - started
    interval = 60 / n
    allowance = n + int(elapsed / interval)
    admitted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert n <= len(admitted) <= allowance and len(refused) == 100 - len(admitted)
    for response in responses:
        assert all(name in response.headers for name in RATE_HEADERS)
        assert response.headers["x-ratelimit-limit-requests"] == str(n)
    # A refusal's wait is TAT + interval - 60 s - now: the TAT is at least start + 60 s once n
    # were admitted and at most what the burst left; "now" lies within the burst.
    earliest, latest = math.ceil(started + interval - ended), math.ceil(last_tat + interval - 60 - started)
    for response in refused:
        assert earliest <= int(response.headers["retry-after"]) <= latest
        error = response.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"


def test_retry_after_is_exact_by_redis_clock(limits_gateway, redis_server):
    key = new_key(redis_server, requests_per_minute=2)
    assert [chat_raw(limits_gateway, key, max_tokens=5).status_code for _ in range(2)] == [200, 200]
    tat = int(counter(redis_server.url, key, 0)) / 1e6
    before = redis_clock(redis_server.url)
    refused = chat_raw(limits_gateway, key, max_tokens=5)
    after = redis_clock(redis_server.url)
    assert refused.status_code == 429
    # GCRA: the next request fits when its TAT (tat + 30 s) is within 60 s of now.
    assert int(refused.headers["retry-after"]) in {math.ceil(tat + 30 - 60 - after), math.ceil(tat + 30 - 60 - before)}
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"


def test_tokens_are_reserved_then_settled_to_reported_usage(limits_gateway, redis_server):
    key = new_key(redis_server, tokens_per_minute=1000)
    first = chat_raw(limits_gateway, key, max_tokens=max_tokens_reserving(905))
    assert first.status_code == 200
    assert first.headers["x-ratelimit-remaining-tokens"] == "95"  # a fresh bucket: exact
    assert counter(redis_server.url, key, 3) == str(USAGE["total_tokens"])  # settled to the reported usage
    second_tokens = max_tokens_reserving(400)
    # 905 + 400 > 1000: fits only because of the refund
    second = chat_raw(limits_gateway, key, max_tokens=second_tokens)
    assert second.status_code == 200, second.text
    # Waiting only adds capacity, so this bound holds however long the test took.
    assert int(second.headers["x-ratelimit-remaining-tokens"]) >= 1000 - USAGE["total_tokens"] - 400
    too_big = chat_raw(limits_gateway, key, max_tokens=4000)  # more than the whole per-minute limit, under the ceiling
    assert too_big.status_code == 429 and too_big.json()["error"]["type"] == "tokens"


def test_concurrency_slot_is_released_when_the_client_disconnects(
    limits_gateway, stream_recording_upstream, redis_server
):
    key = new_key(redis_server, max_concurrent_requests=1)
    llm = client(limits_gateway, key)
    stream_recording_upstream.slow_ended.clear()
    stream = llm.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        stream=True,
        max_tokens=50,
        extra_headers={"x-test-scenario": "slow"},
    )
    next(iter(stream))
    busy = chat_raw(limits_gateway, key, max_tokens=5)
    assert busy.status_code == 429 and busy.json()["error"]["type"] == "requests"
    assert busy.headers["retry-after"] == "1"
    stream.close()  # disconnect mid-stream
    assert stream_recording_upstream.slow_ended.wait(HANG_BOUND_S)
    eventually(
        lambda: chat_raw(limits_gateway, key, max_tokens=5).status_code == 200,
        "the slot was not released after the disconnect",
    )


def test_daily_budget_exhausted_is_429_naming_the_budget(limits_gateway, redis_server):
    first_reserves, second_reserves = 400, 410
    for _ in range(2):  # a UTC midnight between the two requests starts a new budget: run it again
        day = int(redis_clock(redis_server.url) // 86_400)
        key = new_key(redis_server, daily_token_budget=first_reserves + 10)
        first = chat_raw(limits_gateway, key, max_tokens=max_tokens_reserving(first_reserves))
        assert first.status_code == 200  # billed 13
        before = redis_clock(redis_server.url)
        refused = chat_raw(limits_gateway, key, max_tokens=max_tokens_reserving(second_reserves))  # 13 + 410 > 410
        after = redis_clock(redis_server.url)
        if int(after // 86_400) == day:
            break
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert error["code"] == "daily_token_budget_exceeded" and "daily token budget" in error["message"]
    midnight = (day + 1) * 86_400  # by Redis's clock, the one the script uses
    assert math.ceil(midnight - after) <= int(refused.headers["retry-after"]) <= math.ceil(midnight - before)
    with pytest.raises(openai.RateLimitError):
        client(limits_gateway, key).chat.completions.create(
            model="tiny",
            max_tokens=max_tokens_reserving(second_reserves),
            messages=[{"role": "user", "content": PROMPT}],
        )


def test_stream_usage_is_requested_upstream_and_stripped_unless_asked(
    limits_gateway, stream_recording_upstream, redis_server
):
    llm = client(limits_gateway, new_key(redis_server))
    for asked in (False, True):
        extra = {"stream_options": {"include_usage": True}} if asked else {}
        chunks = list(
            llm.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPT}], stream=True, **extra
            )
        )
        assert stream_recording_upstream.bodies[-1]["stream_options"] == {
            "include_usage": True,
            "continuous_usage_stats": True,
        }
        usage = [c.usage for c in chunks if c.usage is not None]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(WORDS)
        if asked:
            assert usage and usage[-1].total_tokens == USAGE["total_tokens"]
        else:
            assert not usage and all(c.choices for c in chunks)


def test_streamed_response_carries_headers_and_is_settled(limits_gateway, redis_server):
    key = new_key(redis_server, tokens_per_minute=1000)
    payload = chat_payload(stream=True, max_tokens=max_tokens_reserving(905, stream=True))
    with httpx.stream(
        "POST",
        f"{limits_gateway}/v1/chat/completions",
        content=payload,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    ) as response:
        assert response.headers["x-ratelimit-remaining-tokens"] == "95"  # set before streaming started
        response.read()
    # Settled before the last bytes were sent: the day's counter holds what was billed, not the
    # reservation, the moment the client has the whole answer. No clock is involved.
    assert counter(redis_server.url, key, 3) == str(USAGE["total_tokens"])


def test_refused_requests_charge_no_limit_at_all(limits_gateway, redis_server):
    """All or nothing: a request refused by one limit leaves every other limit as it was."""
    key = new_key(redis_server, requests_per_minute=5, tokens_per_minute=1000, max_concurrent_requests=3)
    assert chat_raw(limits_gateway, key, max_tokens=max_tokens_reserving(900)).status_code == 200  # billed 13
    state = [counter(redis_server.url, key, i) for i in range(4)]
    # More than a whole minute of tokens: refused however long the first request took (a refusal
    # that leaned on the 13 already spent turned into a 200 whenever 0.7 s passed between them).
    refused = chat_raw(limits_gateway, key, max_tokens=max_tokens_reserving(1500))
    assert refused.status_code == 429 and refused.json()["error"]["type"] == "tokens"
    assert [counter(redis_server.url, key, i) for i in range(4)] == state  # request TAT, tokens, slots, day


@pytest.mark.parametrize(
    ("prompt", "commands"),
    [
        # A small body is read first, then all limits at once: the key lookup, admit, settle.
        (PROMPT, ["GET", "EVALSHA", "EVALSHA"]),
        # A large one takes its request and concurrency allowance before it is read: one more.
        ("x" * 70_000, ["GET", "EVALSHA", "EVALSHA", "EVALSHA"]),
    ],
)
def test_redis_commands_per_admitted_request(stream_recording_upstream, prompt, commands):
    own = start_redis()
    try:
        key = create_key_sync(own.url, "acme", "count")
        with serving(
            create_app(
                settings_for(stream_recording_upstream.url, own.url, max_body_bytes=200_000), RedisKeyStore(own.url)
            )
        ) as gw:
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
            body = json.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": prompt}]})
            counted = httpx.post(
                f"{gw}/v1/chat/completions",
                content=body,
                timeout=HANG_BOUND_S,
                headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
            assert counted.status_code == 200, counted.text
            ender.get("end-of-count")
            thread.join(HANG_BOUND_S)
            watcher.close()
            ender.close()
        assert seen == commands, seen
    finally:
        own.stop()


@pytest.mark.parametrize("mode", ["closed", "local"])
def test_redis_down_fail_modes(stream_recording_upstream, mode):
    own = start_redis()
    try:
        store = MemoryKeyStore()  # keys stay checkable; only the limiter's Redis goes away
        key, _ = asyncio.run(store.create("acme", "failmode", limits={"requests_per_minute": 3}))
        settings = settings_for(stream_recording_upstream.url, own.url, limiter_fail_mode=mode)
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


def test_slot_is_released_when_the_upstream_is_down(redis_server):
    key = new_key(redis_server, max_concurrent_requests=1)
    dead = settings_for(f"http://127.0.0.1:{free_port()}", redis_server.url)
    with serving(create_app(dead, RedisKeyStore(redis_server.url))) as gw:
        for _ in range(2):  # a leaked slot would make the second one a 429
            failed = chat_raw(gw, key, max_tokens=5)
            assert failed.status_code == 503 and "x-ratelimit-remaining-requests" in failed.headers


def test_scripts_reload_after_a_script_flush(limits_gateway, redis_server):
    key = new_key(redis_server, requests_per_minute=10)
    assert chat_raw(limits_gateway, key, max_tokens=5).headers["x-ratelimit-remaining-requests"] == "9"
    flusher = redis.Redis.from_url(redis_server.url)
    flusher.script_flush()  # as after a Redis restart: EVALSHA gets NOSCRIPT, redis-py falls back to EVAL
    flusher.close()
    errors_before = limiter_errors(limits_gateway)
    again = chat_raw(limits_gateway, key, max_tokens=5)
    assert again.status_code == 200
    # Counted on from Redis's state (a fresh local limiter would say 9 again), with no Redis error.
    assert again.headers["x-ratelimit-remaining-requests"] == "8"
    assert limiter_errors(limits_gateway) == errors_before


def limiter_errors(limits_gateway: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(httpx.get(f"{limits_gateway.metrics}/metrics").text):
        for sample in family.samples:
            if sample.name == "llmstack_gateway_redis_errors_total" and sample.labels.get("component") == "limiter":
                return sample.value
    return 0.0
