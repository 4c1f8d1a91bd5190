"""The fair queue across OS processes sharing one redis-server: capacity is never exceeded, and a
killed gateway leaks neither its slot nor its place in the queue."""

from __future__ import annotations

import asyncio
import multiprocessing

import redis
import redis.asyncio

from serving.gateway.config.queue_policy import ModelQueue
from serving.gateway.queue.fair_queue import FairQueue, queue_keys
from tests.support.fair_queue import (
    HANG_BOUND_S,
    POLICY,
    fresh_model,
    one_slot,
    opened,
)

# --- several processes -------------------------------------------------------------------------

PROBE = "fq-test:holders"


def _hammer(url: str, model: str, rounds: int, concurrency: int, capacity: int) -> None:
    """One gateway process: `concurrency` callers acquire, count themselves in an independent Redis
    counter while holding the slot, and release, `rounds` times each."""

    async def main() -> None:
        queue = FairQueue(url, POLICY, {model: ModelQueue(max_ongoing_requests=capacity)}, lease_s=10, heartbeat_s=1)
        await queue.start()
        probe = redis.asyncio.Redis.from_url(url)
        try:

            async def caller(n: int) -> None:
                for _ in range(rounds):
                    async with queue.slot(model, f"t{n % 3}", weight=1 + n % 2):
                        holders = await probe.incr(PROBE)
                        await probe.eval(
                            "if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then "
                            "redis.call('SET', KEYS[1], ARGV[1]) end",
                            1,
                            f"{PROBE}:peak",
                            holders,
                        )
                        await asyncio.sleep(0.002)
                        await probe.decr(PROBE)

            await asyncio.gather(*(caller(n) for n in range(concurrency)))
        finally:
            await probe.aclose()
            await queue.aclose()

    asyncio.run(main())


def test_two_processes_never_exceed_capacity(redis_server):
    model, capacity = fresh_model(), 3
    client = redis.Redis.from_url(redis_server.url)
    client.delete(PROBE, f"{PROBE}:peak")
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_hammer, args=(redis_server.url, model, 15, 8, capacity)) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
        assert worker.exitcode == 0
    peak = int(client.get(f"{PROBE}:peak"))
    assert peak == capacity  # reached (16 callers contend for 3 slots) and never passed
    assert client.zcard(queue_keys(model, len(POLICY.tiers)).inflight) == 0
    client.close()


def _hold_and_wait(url: str, model: str, ready: multiprocessing.synchronize.Event) -> None:
    """A gateway process that holds the model's slot and has a request waiting, until it is killed."""

    async def main() -> None:
        queue = FairQueue(url, POLICY, {model: one_slot()}, lease_s=5.0, heartbeat_s=0.5)
        await queue.start()
        await queue.acquire(model, "doomed")
        waiter = asyncio.create_task(queue.acquire(model, "doomed"))
        while sum((await queue.status(model))["queued"].values()) < 1:
            await asyncio.sleep(0.02)
        ready.set()
        await waiter

    asyncio.run(main())


def test_a_killed_gateway_leaks_neither_its_slot_nor_its_place_in_the_queue(redis_server):
    model = fresh_model()
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    doomed = spawn.Process(target=_hold_and_wait, args=(redis_server.url, model, ready))
    doomed.start()
    try:
        assert ready.wait(HANG_BOUND_S)
    finally:
        doomed.kill()
        doomed.join()

    async def survivor() -> None:
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            status = await queue.status(model)
            assert (status["in_flight"], sum(status["queued"].values())) == (1, 1)  # not yet expired
            ticket = await queue.acquire(model, "survivor")  # admitted once the dead leases expire
            assert sum((await queue.status(model))["queued"].values()) == 0
            await ticket.release()
        finally:
            await queue.aclose()

    asyncio.run(survivor())
    client = redis.Redis.from_url(redis_server.url)
    keys = queue_keys(model, len(POLICY.tiers))
    # The dead process's slot left no count behind: its tenant does not look busy forever.
    assert (client.hlen(keys.slots), client.hlen(keys.holders)) == (0, 0)
    client.close()
