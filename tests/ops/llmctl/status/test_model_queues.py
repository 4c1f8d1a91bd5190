"""`llmctl status` per model: the capacity per replica the gateway allows now, what is in flight
and queued, and the mean queue wait, read from a real redis-server holding a real fair queue's
keys and from the gateway's own metrics exposition."""

from __future__ import annotations

import asyncio

import redis

from infra.spec.stack_file import load_stack
from ops.llmctl.status.cli import model_queues, tables
from ops.llmctl.status.report import StatusReport, model_queue_row, queue_wait_means
from serving.gateway.capacity.store import capacity_key
from serving.gateway.config.queue_policy import ModelQueue
from serving.gateway.queue.fair_queue import FairQueue
from serving.gateway.telemetry.metrics import GatewayMetrics
from tests.support.waiting import eventually_async


def test_status_shows_each_models_adapted_capacity_in_flight_and_queued(redis_server):
    spec = load_stack("local")
    model = spec.models[0]
    name, ceiling = model.model_name, model.autoscaling.max_ongoing_requests
    policy = spec.gateway.queue
    client = redis.Redis.from_url(redis_server.url)
    # The adaptive capacity cut the model to 1 per replica (capacity.lua's hash); a fair queue
    # then holds one slot and one request waits.
    client.hset(capacity_key(name), mapping={"slots": 1, "move": "down"})

    async def scenario() -> None:
        queue = FairQueue(
            redis_server.url,
            policy,
            {name: ModelQueue(max_ongoing_requests=ceiling, max_replicas=1)},
            adaptive=[name],
        )
        await queue.start()
        try:
            held = await queue.acquire(name, "acme")
            waiting = asyncio.create_task(queue.acquire(name, "other"))
            await eventually_async(lambda: _queued(queue, name), "a request waiting for the one slot")
            rows = await asyncio.to_thread(model_queues, spec, redis_server.url, None)
            row = next(r for r in rows if r.model == name)
            assert (row.capacity_per_replica, row.max_per_replica, row.move) == (1, ceiling, "down")
            assert (row.in_flight, row.queued) == (1, 1)
            await held.release()
            await (await waiting).release()
        finally:
            await queue.aclose()
            client.delete(capacity_key(name))
            client.close()

    asyncio.run(scenario())
    # The table a user reads.
    report = StatusReport(
        stack="local",
        where="test",
        models=[
            model_queue_row(
                name,
                max_per_replica=ceiling,
                adaptive=True,
                in_flight=1,
                queued=1,
                adapted_slots="2",
                adapted_move="down",
                queue_wait_s=0.25,
            )
        ],
    )
    rendered = [t for t in tables(report) if "capacity" in str(t.title)]
    assert rendered and rendered[0].row_count == 1


async def _queued(queue: FairQueue, model: str) -> bool:
    return sum((await queue.status(model))["queued"].values()) == 1


def test_the_capacity_shown_is_the_one_the_fair_queue_uses():
    row = lambda **kw: model_queue_row(  # noqa: E731
        "m", max_per_replica=64, in_flight=0, queued=0, queue_wait_s=None, **kw
    )
    assert row(adaptive=True, adapted_slots="12", adapted_move="in_band").capacity_per_replica == 12
    assert (
        row(adaptive=True, adapted_slots="100", adapted_move="up").capacity_per_replica == 64
    )  # never past the ceiling
    assert row(adaptive=True, adapted_slots="0", adapted_move="down").capacity_per_replica == 1  # nor below one
    assert row(adaptive=True, adapted_slots=None, adapted_move=None).move == "unmeasured"
    fixed = row(adaptive=False, adapted_slots="12", adapted_move="down")  # a day-old hash of an adaptive run
    assert (fixed.capacity_per_replica, fixed.move) == (64, "fixed")


def test_the_mean_queue_wait_comes_from_the_gateways_histogram():
    metrics = GatewayMetrics(["tiny", "other"])
    for seconds, tier in ((0.1, "standard"), (0.3, "standard"), (0.5, "batch")):
        metrics.queue_wait.labels(model="tiny", tier=tier).observe(seconds)
    means = queue_wait_means(metrics.exposition().decode())
    assert abs(means["tiny"] - 0.3) < 1e-9
    assert "other" not in means  # nothing admitted: no mean, not 0
