"""The gateway as it runs in a pod (`python -m serving.gateway`), under load and faults:
two gateway processes sharing one key, Redis dying and coming back mid-load, the upstream
killed mid-stream, SIGTERM with many streams in flight.

Real processes throughout: redis-server, gateway processes, and `ops.harness.stub_upstream` as
the upstream (its own process, so it can be killed). No wall-clock assertions; deadlines
only bound hangs.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import redis

from ops.devstack.local_redis import start_redis
from ops.harness.processes import background, free_port, wait_for_http
from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from tests.support.gateway_process import gateway_process

pytestmark = pytest.mark.slow  # starts gateway processes (python -m serving.gateway)

HANG_BOUND_S = 60
PROMPT = [{"role": "user", "content": "What is a KV cache?"}]  # estimate: 5 tokens


@contextmanager
def stub_upstream(tmp_path: Path, port: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    port = port or free_port()
    with background(
        [sys.executable, "-m", "ops.harness.stub_upstream", "--port", str(port)], tmp_path / f"upstream-{port}.log"
    ) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/v1/models", proc, HANG_BOUND_S)
        yield url, proc


@contextmanager
def gateway(
    tmp_path: Path, upstream: str, redis_url: str, metrics_port: int | None = None, **settings
) -> Iterator[tuple[str, subprocess.Popen]]:
    """A gateway process; /readyz and /metrics are on `metrics_port` (a free one when not given)."""
    port = free_port()
    env = {
        "LLMSTACK_UPSTREAM_URL": upstream,
        "LLMSTACK_REDIS_URL": redis_url,
        "LLMSTACK_GATEWAY_PORT": str(port),
        "LLMSTACK_GATEWAY_METRICS_PORT": str(metrics_port or free_port()),
        # the stub upstream is steered by headers, which the gateway forwards only when listed
        "LLMSTACK_GATEWAY_SETTINGS": json.dumps(
            {"models": ["tiny"], "forward_request_headers": ["x-stub-chunks", "x-stub-interval-ms"], **settings}
        ),
    }
    with gateway_process(env, tmp_path / f"gateway-{port}.log") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/healthz", proc, HANG_BOUND_S)
        yield url, proc


def redis_time(url: str) -> float:
    seconds, micros = redis.Redis.from_url(url).time()
    return seconds + micros / 1e6


def fire(urls: list[str], key: str, count: int, body: bytes) -> list[httpx.Response]:
    """`count` requests at once, spread over the gateways, on up to 200 connections."""

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=HANG_BOUND_S, limits=httpx.Limits(max_connections=200)) as http:
            return await asyncio.gather(
                *[
                    http.post(
                        f"{urls[i % len(urls)]}/v1/chat/completions",
                        content=body,
                        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                    )
                    for i in range(count)
                ]
            )

    return asyncio.run(go())


def body_billed_its_reservation(reserved: int, max_tokens: int = 20) -> bytes:
    """A chat body that reserves exactly `reserved` tokens, to which the stub reports exactly that
    usage, so settlement refunds nothing. The reservation, by hand: the body's bytes, 4 tokens
    for each of its 7 JSON values, 256 for the chat template (the default), and max_tokens."""

    def body(padding: int, prompt_tokens: int) -> bytes:
        steer = json.dumps({"chunks": max_tokens, "prompt_tokens": f"{prompt_tokens:05d}"})
        message = {"role": "user", "content": f"#stub {steer}\n" + "x" * padding}
        return json.dumps({"model": "tiny", "max_tokens": max_tokens, "messages": [message]}).encode()

    padding = reserved - (len(body(0, 0)) + 4 * 7 + 256 + max_tokens)
    assert padding >= 0, "reserve more"
    made = body(padding, reserved - max_tokens)
    assert len(made) + 4 * 7 + 256 + max_tokens == reserved
    return made


def test_two_gateway_processes_200_clients_never_exceed_the_gcra_allowance(redis_server, tmp_path):
    # Each request reserves 500 tokens and is billed exactly that (the stub reports it), so no
    # refund adds capacity: GCRA alone bounds what is admitted. 60e6 us / 12,500 is a whole 4,800 us.
    rpm, tpm, reserved = 50, 12_500, 500
    by_requests = create_key_sync(
        redis_server.url,
        "acme",
        "rpm",
        limits={"requests_per_minute": rpm, "tokens_per_minute": 10_000_000, "max_concurrent_requests": 1000},
    )
    by_tokens = create_key_sync(
        redis_server.url,
        "acme",
        "tpm",
        limits={"requests_per_minute": 100_000, "tokens_per_minute": tpm, "max_concurrent_requests": 1000},
    )
    body = body_billed_its_reservation(reserved)
    with (
        stub_upstream(tmp_path) as (upstream, _),
        gateway(tmp_path, upstream, redis_server.url) as (gw1, _),
        gateway(tmp_path, upstream, redis_server.url) as (gw2, _),
    ):
        for key, burst, per_second in [(by_requests, rpm, rpm / 60), (by_tokens, tpm // reserved, tpm / 60 / reserved)]:
            started = redis_time(redis_server.url)
            responses = fire([gw1, gw2], key, 200, body)
            elapsed = redis_time(redis_server.url) - started
            statuses = Counter(r.status_code for r in responses)
            assert set(statuses) <= {200, 429}, statuses
            # GCRA by Redis's clock (the one the script uses): the burst, plus what refilled
            # while the 200 requests were in flight. Never more, whatever the interleaving; two
            # gateways each keeping its own limits would admit twice the burst.
            assert burst <= statuses[200] <= burst + int(per_second * elapsed), (statuses, elapsed)
        # Revocation holds on every replica from the very next request: both read Redis each time.
        for key in (by_requests, by_tokens):
            assert asyncio.run(revoke(redis_server.url, key))
            for gw in (gw1, gw2):
                answer = httpx.post(
                    f"{gw}/v1/chat/completions",
                    content=body,
                    headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
                )
                assert answer.status_code == 401, answer.text


async def revoke(redis_url: str, key: str) -> bool:
    store = RedisKeyStore(redis_url)
    try:
        return await store.revoke(key.removeprefix("sk-llm-").split("_")[0])
    finally:
        await store.aclose()


def test_redis_killed_and_restarted_mid_load(tmp_path):
    own = start_redis()
    try:
        key = create_key_sync(
            own.url, "acme", "outage", limits={"requests_per_minute": 100_000, "tokens_per_minute": 10_000_000}
        )
        served: list[tuple[float, float, str]] = []  # (started, ended, outcome) of every request, by monotonic clock
        stop = threading.Event()
        metrics_port = free_port()
        admin = f"http://127.0.0.1:{metrics_port}"
        with stub_upstream(tmp_path) as (upstream, _), gateway(tmp_path, upstream, own.url, metrics_port) as (gw, _):
            llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)

            def load() -> None:
                while not stop.is_set():
                    started = time.monotonic()
                    try:
                        text = "".join(
                            c.choices[0].delta.content or ""
                            for c in llm.chat.completions.create(model="tiny", messages=PROMPT, stream=True)
                            if c.choices
                        )
                        outcome = "whole" if text == " tok" * 8 else "truncated"
                    except openai.APIStatusError as exc:
                        outcome = str(exc.status_code)
                    except Exception as exc:  # noqa: BLE001 - anything else is counted, never lost with the thread
                        outcome = type(exc).__name__
                    served.append((started, time.monotonic(), outcome))

            workers = [threading.Thread(target=load) for _ in range(4)]
            for worker in workers:
                worker.start()
            time.sleep(1)
            redis.Redis.from_url(own.url).save()  # a snapshot to come back with, as a persisted Redis would
            snapshot = tmp_path / "dump.rdb"
            shutil.copyfile(own.folder / "dump.rdb", snapshot)
            port = own.port
            stopping = time.monotonic()
            own.stop()  # Redis gone mid-load
            stopped = time.monotonic()
            time.sleep(2)
            degraded = httpx.get(f"{admin}/readyz").json()
            restarting = time.monotonic()
            own = start_redis(port, load=snapshot)  # back on the same address, with its data
            restarted = time.monotonic()
            time.sleep(2)
            stop.set()
            for worker in workers:
                worker.join(HANG_BOUND_S)
            assert not any(worker.is_alive() for worker in workers), "a worker hung"
            ready = httpx.get(f"{admin}/readyz").json()
            metrics = httpx.get(f"{admin}/metrics").text
        assert degraded["status"] == "degraded" and ready == {"status": "ready"}
        assert {outcome for _, _, outcome in served} == {"whole"}, served  # every request served in full
        # Requests wholly inside each period, not ones merely counted by then (still running).
        assert any(end < stopping for _, end, _ in served)
        assert any(stopped < start and end < restarting for start, end, _ in served)
        assert any(start > restarted for start, _, _ in served)
        assert "llmstack_gateway_degraded 0.0" in metrics  # recovered without a restart
        assert 'llmstack_gateway_redis_errors_total{component="keys"}' in metrics
    finally:
        own.stop()


def test_upstream_killed_mid_stream(redis_server, tmp_path):
    key = create_key_sync(redis_server.url, "acme", "kill", limits={"max_concurrent_requests": 1})
    port = free_port()
    with (
        stub_upstream(tmp_path, port) as (upstream, upstream_proc),
        gateway(tmp_path, upstream, redis_server.url, upstream_idle_timeout_s=10) as (gw, _),
    ):
        # The client waits far longer than the gateway would: a gateway that hung shows as a timeout.
        llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        endless = [{"role": "user", "content": '#stub {"chunks": 1000, "interval_ms": 20}'}]
        stream = llm.chat.completions.create(model="tiny", messages=endless, stream=True)
        chunks = iter(stream)
        next(chunks)
        upstream_proc.send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIConnectionError) as cut:  # a broken stream, not a clean (truncated) end
            for _ in chunks:
                pass
        assert not isinstance(cut.value, openai.APITimeoutError)
        with pytest.raises(openai.InternalServerError) as caught:  # upstream down: 503 at once
            llm.chat.completions.create(model="tiny", messages=PROMPT)
        assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"]
        with stub_upstream(tmp_path, port):  # back: the key's only slot was released on both failures
            assert llm.chat.completions.create(model="tiny", messages=PROMPT).choices[0].message.content


def test_sigterm_finishes_every_stream_in_flight(redis_server, tmp_path):
    streams = 20
    key = create_key_sync(redis_server.url, "acme", "drain", limits={"max_concurrent_requests": streams})
    with (
        stub_upstream(tmp_path) as (upstream, _),
        gateway(tmp_path, upstream, redis_server.url, shutdown_grace_s=60) as (gw, gw_proc),
    ):
        llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        opened = [
            iter(
                llm.chat.completions.create(
                    model="tiny",
                    messages=PROMPT,
                    stream=True,
                    extra_headers={"x-stub-chunks": "40", "x-stub-interval-ms": "50"},
                )
            )
            for _ in range(streams)
        ]  # each runs ~2 s
        texts = ["".join(c.delta.content or "" for c in next(s).choices) for s in opened]  # all in flight
        gw_proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + HANG_BOUND_S
        while time.monotonic() < deadline:  # stops accepting new connections...
            try:
                httpx.get(f"{gw}/healthz", timeout=1)
                time.sleep(0.05)
            except httpx.TransportError:
                break
        else:
            raise AssertionError("the gateway kept accepting connections after SIGTERM")
        for i, chunks in enumerate(opened):  # ...and finishes every stream it had
            texts[i] += "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)
        assert texts == [" tok" * 40] * streams
        assert gw_proc.wait(HANG_BOUND_S) in (0, -signal.SIGTERM)
