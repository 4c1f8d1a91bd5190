"""The fair queue across gateway *processes*: two `python -m serving.gateway` subprocesses share one
redis-server in front of one upstream that counts what it runs. In flight never exceeds the
model's capacity (by the upstream's own count and by Redis), and a gateway SIGKILLed while it
has requests in flight and waiting leaks no slot: once its leases run out (FairQueue's lease_s),
the survivor fills the model's whole capacity again.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from ops.harness.processes import free_port, wait_for_http
from ops.harness.stub_gateway import gateway_env
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.queue.fair_queue import DEFAULT_LEASE_S, queue_keys
from tests.support.counting_upstream import CountingUpstream
from tests.support.gateway import GENEROUS
from tests.support.gateway_process import gateway_process
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow  # starts gateway processes (python -m serving.gateway)


@contextmanager
def queue_gateway_process(upstream: str, redis_url: str, model: str, capacity: int, log: Path) -> Iterator[tuple]:
    """`python -m serving.gateway` as its own OS process: yields (API URL, the Popen)."""
    port = free_port()
    settings = {
        "models": [model],
        "model_context_lengths": {model: 4096},
        "queue": {"tiers": [{"name": "standard", "max_queue_length": 64, "queue_timeout_s": 120}]},
        "model_queues": {model: {"max_ongoing_requests": capacity}},
    }
    env = gateway_env(upstream=upstream, redis_url=redis_url, port=port, settings=settings)
    with gateway_process(env, log) as process:
        wait_for_http(f"http://127.0.0.1:{port}/healthz", process, timeout_s=60)
        yield f"http://127.0.0.1:{port}", process


def chat(api: str, key: str, model: str, what: str) -> int:
    try:
        return httpx.post(
            f"{api}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": what}]},
            timeout=HANG_BOUND_S * 2,
        ).status_code
    except httpx.TransportError:
        return 0  # its gateway was killed


def redis_counts(redis_url: str, model: str) -> tuple[int, int]:
    """(in flight, queued) of a model, as Redis holds them."""
    keys = queue_keys(model, 1)
    with redis.Redis.from_url(redis_url) as client:
        return client.zcard(keys.inflight), client.zcard(keys.queues[0])


def test_two_gateway_processes_never_run_more_than_the_models_capacity(redis_server, tmp_path):
    model, capacity = f"m-{uuid.uuid4().hex[:8]}", 3
    key = create_key_sync(redis_server.url, "acme", "procs", limits=GENEROUS)
    counting = CountingUpstream(sleep_s=0.05)
    most_in_redis = 0
    stop = threading.Event()

    def watch_redis() -> None:
        nonlocal most_in_redis
        while not stop.is_set():
            most_in_redis = max(most_in_redis, redis_counts(redis_server.url, model)[0])
            time.sleep(0.005)

    with (
        serving(counting.app()) as upstream,
        queue_gateway_process(upstream, redis_server.url, model, capacity, tmp_path / "one.log") as (one, _),
        queue_gateway_process(upstream, redis_server.url, model, capacity, tmp_path / "two.log") as (two, _),
        ThreadPoolExecutor(24) as pool,
    ):
        watcher = threading.Thread(target=watch_redis, daemon=True)
        watcher.start()
        statuses = list(pool.map(lambda api: chat(api, key, model, "sleep"), [one, two] * 20))
        stop.set()
        watcher.join(HANG_BOUND_S)
    assert statuses == [200] * 40
    assert counting.served == 40
    assert counting.peak == capacity  # saturated, and never over: the two processes shared one capacity
    assert most_in_redis == capacity
    assert redis_counts(redis_server.url, model) == (0, 0)


def test_a_sigkilled_gateway_process_leaks_no_slot(redis_server, tmp_path):
    model, capacity = f"m-{uuid.uuid4().hex[:8]}", 2
    key = create_key_sync(redis_server.url, "acme", "procs", limits=GENEROUS)
    counting = CountingUpstream(sleep_s=0.05)
    with (
        serving(counting.app()) as upstream,
        queue_gateway_process(upstream, redis_server.url, model, capacity, tmp_path / "survivor.log") as (survivor, _),
        ThreadPoolExecutor(8) as pool,
    ):
        with queue_gateway_process(upstream, redis_server.url, model, capacity, tmp_path / "victim.log") as (
            victim,
            process,
        ):
            held = [pool.submit(chat, victim, key, model, "hold") for _ in range(capacity)]
            eventually(lambda: counting.running == capacity, "the victim fills the model")
            waiting = [pool.submit(chat, victim, key, model, "hold") for _ in range(2)]
            eventually(lambda: redis_counts(redis_server.url, model) == (capacity, 2), "the victim has two waiters")
            process.kill()  # SIGKILL: no release, no cancel, no shutdown of any kind
            process.wait()
        assert [f.result() for f in [*held, *waiting]] == [0] * (capacity + 2)
        eventually(lambda: counting.running == 0, "the upstream sees the victim's requests go")
        assert redis_counts(redis_server.url, model) == (capacity, 2)  # Redis still holds them: the leases do
        # The survivor's requests wait for the dead process's leases, then take the whole capacity.
        after = [pool.submit(chat, survivor, key, model, "hold") for _ in range(capacity)]
        eventually(
            lambda: counting.running == capacity,
            "the survivor gets every slot back",
            bound_s=DEFAULT_LEASE_S + HANG_BOUND_S,
        )
        assert redis_counts(redis_server.url, model) == (capacity, 0)  # the dead waiters left the queue too
        counting.gate.set()
        assert [f.result() for f in after] == [200] * capacity
    assert redis_counts(redis_server.url, model) == (0, 0)
