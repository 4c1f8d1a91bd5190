"""The gateway queue's figures as Serve's controller reads them: from the keys the gateway's own
fair queue writes in a real redis-server, read-only, and refreshed in the background."""

from __future__ import annotations

import asyncio

import pytest
import redis

from serving.autoscaling.gateway_queue import REDIS_URL_ENV, GatewayQueue, QueueSource, read_figures
from serving.gateway.capacity.store import capacity_key
from serving.gateway.queue.fair_queue import queue_keys
from tests.support.fair_queue import HANG_BOUND_S, POLICY, fresh_model, one_slot, opened, queued_at_least
from tests.support.waiting import eventually, eventually_async


def source(model: str) -> QueueSource:
    return QueueSource(model=model, tiers=len(POLICY.tiers), max_ongoing_requests=1, max_replicas=1)


async def with_waiters(url: str, model: str, waiting: int, check) -> None:
    """Hold the model's one slot (after one served request, so the queue knows a mean slot time),
    queue `waiting` requests behind it, run `check()` in a thread, and let them all go."""
    queue = await opened(url, {model: one_slot()})
    try:
        first = await queue.acquire(model, "a")
        await asyncio.sleep(0.05)
        await first.release()
        blocker = await queue.acquire(model, "a")
        tasks = [asyncio.create_task(queue.acquire(model, f"t{i}", tier="standard")) for i in range(waiting)]
        try:
            await eventually_async(lambda: queued_at_least(queue, model, waiting), "queued")
            await asyncio.to_thread(check)
        finally:
            await blocker.release()

        async def served(task: asyncio.Task) -> None:
            await (await task).release()

        # Whichever the queue admits first releases first: awaiting them in creation order would
        # hold the one slot for a waiter that arrived later and deadlock until the queue's timeout.
        await asyncio.wait_for(asyncio.gather(*(served(task) for task in tasks)), HANG_BOUND_S)
    finally:
        await queue.aclose()


def test_depth_and_expected_wait_from_the_gateways_own_keys(redis_server):
    model = fresh_model()
    client = redis.Redis.from_url(redis_server.url)
    seen = {}

    def check() -> None:
        seen["figures"] = read_figures(client, source(model))
        svc_us = int(client.hget(queue_keys(model, len(POLICY.tiers)).state, "svc_us"))
        seen["slot_s"] = svc_us / 1e6
        client.hset(capacity_key(model), "slots", 3)  # the adaptive capacity per replica, when it ran
        seen["adapted"] = read_figures(client, source(model))

    asyncio.run(with_waiters(redis_server.url, model, 3, check))
    figures, slot_s = seen["figures"], seen["slot_s"]
    assert figures.depth == 3
    assert slot_s > 0
    assert figures.expected_wait_s == pytest.approx(3 * slot_s / 1)  # 3 waiting, 1 slot on 1 replica
    assert seen["adapted"].expected_wait_s == pytest.approx(3 * slot_s / 3)
    assert read_figures(client, source(model)).depth == 0
    client.close()


def test_an_unknown_model_reads_as_an_empty_queue_with_no_known_wait(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    figures = read_figures(client, source(fresh_model()))
    assert (figures.depth, figures.expected_wait_s) == (0, None)
    client.close()


def test_the_background_reader_serves_the_cache_and_says_unknown_without_redis(redis_server, monkeypatch):
    model = fresh_model()
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    assert not GatewayQueue(source(model)).watched
    assert GatewayQueue(source(model)).figures() is None
    monkeypatch.setenv(REDIS_URL_ENV, redis_server.url)
    reader = GatewayQueue(source(model), refresh_s=0.05, stale_s=5)
    assert reader.watched

    def check() -> None:
        eventually(lambda: (f := reader.figures()) is not None and f.depth == 2, "background figures")

    asyncio.run(with_waiters(redis_server.url, model, 2, check))
    monkeypatch.setenv(REDIS_URL_ENV, "redis://127.0.0.1:1")  # nothing listens: never read, so unknown
    down = GatewayQueue(source(model), refresh_s=0.05, stale_s=5)
    assert down.watched and down.figures() is None
