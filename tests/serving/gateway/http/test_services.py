"""The gateway's lifespan (serving.gateway.http.services): the loops it starts beside the requests
end with it, against a real redis-server."""

from __future__ import annotations

import functools

from serving.gateway.auth.keys import RedisKeyStore
from serving.gateway.capacity.store import AdaptiveCapacity
from serving.gateway.http import services
from serving.gateway.http.app import create_apps
from serving.gateway.queue.fair_queue import FairQueue
from serving.gateway.telemetry.redis_memory import watch_redis_memory
from tests.support.gateway import gateway_settings
from tests.support.lifespan import loops_left_after_shutdowns

PAUSE_S = 0.001  # each loop's pause between its Redis calls: busy loops, so cancels land mid-call
# The lifespan's loops of Redis calls, by their coroutine's __qualname__ (the batch runner's have
# their own test, tests/serving/gateway/batch/test_runner.py).
REDIS_LOOPS = {"watch_redis_memory", "CapacityStore.run", "FairQueue._listen", "FairQueue._heartbeat"}


def test_shutdown_ends_the_loops_of_redis_calls_even_when_a_call_swallows_the_cancel(redis_server, monkeypatch):
    # On Python 3.11 redis-py sends each command under asyncio.wait_for, which returns the
    # command's result when the command ends just as the cancel lands (python/cpython#86296):
    # a loop busy in Redis loses a good share of the cancels the lifespan's shutdown sends it. It
    # must end all the same, or the shutdown waits for it forever and it outlives the gateway (and
    # the redis-server it polls).
    model = "tiny"
    queues: list[FairQueue] = []

    def fast_queue(*args, **kwargs) -> FairQueue:
        queue = FairQueue(*args, **kwargs, lease_s=1.0, heartbeat_s=PAUSE_S)
        queues.append(queue)
        return queue

    # The pauses are the classes' own defaults (seconds apart), which the stack file does not set.
    monkeypatch.setattr(services, "FairQueue", fast_queue)
    monkeypatch.setattr(services, "AdaptiveCapacity", functools.partial(AdaptiveCapacity, window_s=2 * PAUSE_S))
    monkeypatch.setattr(services, "watch_redis_memory", functools.partial(watch_redis_memory, poll_s=PAUSE_S))
    settings = gateway_settings(
        "http://127.0.0.1:9",  # no request runs: only the loops' own Redis calls matter
        redis_server.url,
        model_queues={model: {"max_ongoing_requests": 64}},
        model_capacities={model: {"ttft_ms": 150, "itl_ms": 100, "min_slots": 64, "max_slots": 64}},
    )

    async def started(running: set[str]) -> None:
        assert running == REDIS_LOOPS
        await queues[-1].acquire(model, "acme")  # a slot held, so the heartbeat renews it in Redis

    make_api = lambda: create_apps(settings, RedisKeyStore(redis_server.url)).api  # noqa: E731
    assert loops_left_after_shutdowns(make_api, REDIS_LOOPS, on_started=started) == []
