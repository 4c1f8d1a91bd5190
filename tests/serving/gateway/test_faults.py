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

from ops.devstack.local_redis import redis_server_path, start_redis
from ops.harness.processes import background, free_port, wait_for_http
from serving.gateway.keys import RedisKeyStore, create_key_sync

pytestmark = pytest.mark.skipif(redis_server_path() is None, reason="needs redis-server (apt-get install redis-server)")

HANG_BOUND_S = 60
PROMPT = [{"role": "user", "content": "What is a KV cache?"}]  # estimate: 5 tokens


@contextmanager
def stub_upstream(tmp_path: Path, port: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    port = port or free_port()
    with background([sys.executable, "-m", "ops.harness.stub_upstream", "--port", str(port)],
                    tmp_path / f"upstream-{port}.log") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/v1/models", proc, HANG_BOUND_S)
        yield url, proc


@contextmanager
def gateway(tmp_path: Path, upstream: str, redis_url: str, metrics_port: int | None = None,
            **settings) -> Iterator[tuple[str, subprocess.Popen]]:
    """A gateway process; /readyz and /metrics are on `metrics_port` (a free one when not given)."""
    port = free_port()
    env = {"LLMSTACK_UPSTREAM_URL": upstream, "LLMSTACK_REDIS_URL": redis_url, "LLMSTACK_GATEWAY_PORT": str(port),
           "LLMSTACK_GATEWAY_METRICS_PORT": str(metrics_port or free_port()),
           # the stub upstream is steered by headers, which the gateway forwards only when listed
           "LLMSTACK_GATEWAY_SETTINGS": json.dumps({"models": ["tiny"], "forward_request_headers": [
               "x-stub-chunks", "x-stub-interval-ms"], **settings})}
    with background([sys.executable, "-m", "serving.gateway"], tmp_path / f"gateway-{port}.log", env) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_for_http(f"{url}/healthz", proc, HANG_BOUND_S)
        yield url, proc


def redis_time(url: str) -> float:
    seconds, micros = redis.Redis.from_url(url).time()
    return seconds + micros / 1e6


def fire(urls: list[str], key: str, count: int, body: dict) -> list[httpx.Response]:
    """`count` requests at once, spread over the gateways, on up to 200 connections."""
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=HANG_BOUND_S, limits=httpx.Limits(max_connections=200)) as http:
            return await asyncio.gather(*[
                http.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {key}"}) for i in range(count)])

    return asyncio.run(go())


def test_two_gateway_processes_200_clients_never_exceed_the_gcra_allowance(redis_server, tmp_path):
    rpm, tpm, reserved = 50, 1_000, 5 + 20  # each request reserves the prompt estimate + max_tokens
    by_requests = create_key_sync(redis_server.url, "acme", "rpm", limits={
        "requests_per_minute": rpm, "tokens_per_minute": 10_000_000, "max_concurrent_requests": 1000})
    by_tokens = create_key_sync(redis_server.url, "acme", "tpm", limits={
        "requests_per_minute": 100_000, "tokens_per_minute": tpm, "max_concurrent_requests": 1000})
    body = {"model": "tiny", "max_tokens": 20, "messages": PROMPT}
    with stub_upstream(tmp_path) as (upstream, _), \
            gateway(tmp_path, upstream, redis_server.url) as (gw1, _), \
            gateway(tmp_path, upstream, redis_server.url) as (gw2, _):
        for key, burst, per_second in [(by_requests, rpm, rpm / 60), (by_tokens, tpm // reserved, tpm / 60 / reserved)]:
            started = redis_time(redis_server.url)
            responses = fire([gw1, gw2], key, 200, body)
            elapsed = redis_time(redis_server.url) - started
            statuses = Counter(r.status_code for r in responses)
            assert set(statuses) <= {200, 429}, statuses
            # GCRA by Redis's clock (the one the script uses): the burst, plus what refilled
            # while the 200 requests were in flight. Never more, whatever the interleaving.
            # (Settlement refunds unused tokens, so the token key may admit a little more as
            # answers come back; the stub uses 8 of the 20 reserved output tokens.)
            refill = per_second * elapsed if key is by_requests else (tpm / 60 * elapsed + 200 * 12) / reserved
            assert burst <= statuses[200] <= burst + int(refill), (statuses, elapsed)
        # Revocation holds on every replica from the very next request: both read Redis each time.
        for key in (by_requests, by_tokens):
            assert asyncio.run(revoke(redis_server.url, key))
            for gw in (gw1, gw2):
                answer = httpx.post(f"{gw}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
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
        key = create_key_sync(own.url, "acme", "outage", limits={
            "requests_per_minute": 100_000, "tokens_per_minute": 10_000_000})
        results: Counter[str] = Counter()
        stop = threading.Event()
        metrics_port = free_port()
        admin = f"http://127.0.0.1:{metrics_port}"
        with stub_upstream(tmp_path) as (upstream, _), \
                gateway(tmp_path, upstream, own.url, metrics_port) as (gw, _):
            llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)

            def load() -> None:
                while not stop.is_set():
                    try:
                        text = "".join(c.choices[0].delta.content or "" for c in llm.chat.completions.create(
                            model="tiny", messages=PROMPT, stream=True) if c.choices)
                        results["whole" if text == " tok" * 8 else "truncated"] += 1
                    except openai.APIStatusError as exc:
                        results[str(exc.status_code)] += 1
                    except openai.APIConnectionError:
                        results["connection"] += 1

            workers = [threading.Thread(target=load) for _ in range(4)]
            for worker in workers:
                worker.start()
            time.sleep(1)
            redis.Redis.from_url(own.url).save()  # a snapshot to come back with, as a persisted Redis would
            snapshot = tmp_path / "dump.rdb"
            shutil.copyfile(own.folder / "dump.rdb", snapshot)
            port = own.port
            before = sum(results.values())
            own.stop()  # Redis gone mid-load
            time.sleep(2)
            degraded = httpx.get(f"{admin}/readyz").json()
            during = sum(results.values())
            own = start_redis(port, load=snapshot)  # back on the same address, with its data
            time.sleep(2)
            stop.set()
            for worker in workers:
                worker.join(HANG_BOUND_S)
            ready = httpx.get(f"{admin}/readyz").json()
            metrics = httpx.get(f"{admin}/metrics").text
        assert degraded["status"] == "degraded" and ready == {"status": "ready"}
        assert set(results) == {"whole"}, results  # every request served in full, outage or not
        assert sum(results.values()) > during > before > 0  # served before, during and after the outage
        assert "llmstack_gateway_degraded 0.0" in metrics  # recovered without a restart
        assert 'llmstack_gateway_redis_errors_total{component="keys"}' in metrics
    finally:
        own.stop()


def test_upstream_killed_mid_stream(redis_server, tmp_path):
    key = create_key_sync(redis_server.url, "acme", "kill", limits={"max_concurrent_requests": 1})
    port = free_port()
    with stub_upstream(tmp_path, port) as (upstream, upstream_proc), \
            gateway(tmp_path, upstream, redis_server.url) as (gw, _):
        llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        stream = llm.chat.completions.create(model="tiny", messages=PROMPT, stream=True, extra_headers={
            "x-stub-chunks": "1000", "x-stub-interval-ms": "20"})
        chunks = iter(stream)
        next(chunks)
        upstream_proc.send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIError):  # an error, not a hang and not a clean (truncated) end
            for _ in chunks:
                pass
        with pytest.raises(openai.InternalServerError) as caught:  # upstream down: 503 at once
            llm.chat.completions.create(model="tiny", messages=PROMPT)
        assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"]
        with stub_upstream(tmp_path, port):  # back: the key's only slot was released on both failures
            assert llm.chat.completions.create(model="tiny", messages=PROMPT).choices[0].message.content


def test_sigterm_finishes_every_stream_in_flight(redis_server, tmp_path):
    streams = 20
    key = create_key_sync(redis_server.url, "acme", "drain", limits={"max_concurrent_requests": streams})
    with stub_upstream(tmp_path) as (upstream, _), \
            gateway(tmp_path, upstream, redis_server.url, shutdown_grace_s=60) as (gw, gw_proc):
        llm = openai.OpenAI(base_url=f"{gw}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        opened = [iter(llm.chat.completions.create(model="tiny", messages=PROMPT, stream=True, extra_headers={
            "x-stub-chunks": "40", "x-stub-interval-ms": "50"})) for _ in range(streams)]  # each runs ~2 s
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
