"""A try for a free slot, sent in another client's round trip (the limiter's admit), against a
real redis-server; and what an unsaturated request costs in round trips."""

from __future__ import annotations

import asyncio
import threading
import time

import redis
import redis.asyncio

from serving.gateway.config.queue_policy import QueuePolicy, QueueTier
from serving.gateway.queue.fair_queue import FairQueue, queue_keys
from serving.gateway.redis.client import run_together
from tests.support.fair_queue import (
    HANG_BOUND_S,
    POLICY,
    RESERVED,
    fresh_model,
    one_slot,
    opened,
    queued_at_least,
)
from tests.support.waiting import eventually_async

# --- a try for a free slot, sent in another client's round trip (the limiter's admit) ------------


async def tried(queue: FairQueue, client, model: str, tenant: str, tier: str | None = None):
    """(the try, the ticket it took or None), sent in a pipeline as the limiter sends it."""
    attempt = queue.try_slot(model, tenant, tier=tier)
    await run_together(client, [attempt.call])
    return attempt, queue.tried(attempt)


async def snapshot(client, model: str, tiers: int) -> dict:
    """Every key of the model's queue, as Redis holds it."""
    read = {
        b"hash": client.hgetall,
        b"zset": lambda name: client.zrange(name, 0, -1, withscores=True),
        b"string": client.get,
    }
    out = {}
    for name in queue_keys(model, tiers).script_keys():
        kind = await client.type(name)
        out[name] = await read[kind](name) if kind in read else None
    return out


def test_a_try_takes_a_free_slot_by_the_admits_rule_and_answers_busy_without_queueing(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(
            redis_server.url, {model: one_slot(max_ongoing_requests=8)}, RESERVED, lease_s=120, heartbeat_s=50
        )  # no lease renewal moves a score mid-test
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            flood = []
            for _ in range(6):
                _, ticket = await tried(queue, client, model, "flood")
                assert ticket is not None and ticket.wait_s == 0
                flood.append(ticket)
            attempt, none = await tried(queue, client, model, "flood")  # alone, it stops short of the reserve
            assert none is None and attempt.busy
            light = [(await tried(queue, client, model, "light"))[1] for _ in range(2)]
            assert all(ticket is not None for ticket in light)  # the reserve, as admit gives it
            assert (await queue.status(model))["in_flight"] == 8
            waiter = asyncio.create_task(queue.acquire(model, "flood"))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "the flood waiting")
            before = await snapshot(client, model, len(RESERVED.tiers))
            for tenant, tier in [("newcomer", None), ("flood", None), ("newcomer", "interactive")]:
                attempt, none = await tried(queue, client, model, tenant, tier)
                assert none is None and attempt.busy
            # Busy changed nothing: no place queued, nobody pushed out, no tenant's tag moved.
            assert await snapshot(client, model, len(RESERVED.tiers)) == before
            await light.pop().release()  # the reserve slot goes to nobody waiting: the flood holds its share
            _, again = await tried(queue, client, model, "light")
            assert again is not None
            for ticket in [*flood, *light, again]:
                await ticket.release()
            await (await asyncio.wait_for(waiter, HANG_BOUND_S)).release()
            keys = queue_keys(model, len(RESERVED.tiers))
            assert (await client.zcard(keys.inflight), await client.hlen(keys.holders)) == (0, 0)
        finally:
            await client.aclose()
            await queue.aclose()

    asyncio.run(scenario())


def test_a_try_never_pushes_a_waiter_out_of_a_full_queue(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()}, lease_s=120, heartbeat_s=50)
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            holder = await queue.acquire(model, "heavy")
            waiters = [asyncio.create_task(queue.acquire(model, "heavy", tier="batch")) for _ in range(3)]
            await eventually_async(lambda: queued_at_least(queue, model, 3), "the batch queue full")
            before = await snapshot(client, model, len(POLICY.tiers))
            for tier in ("batch", "interactive"):  # an admit of either would queue, the batch one pushing out
                attempt, none = await tried(queue, client, model, "light", tier)
                assert none is None and attempt.busy
            assert await snapshot(client, model, len(POLICY.tiers)) == before
            await holder.release()
            # In the order the queue admits them (one slot: each must end before the next),
            # which need not be the order their tasks were made in.
            for admitted in asyncio.as_completed(waiters, timeout=HANG_BOUND_S):
                await (await admitted).release()
        finally:
            await client.aclose()
            await queue.aclose()

    asyncio.run(scenario())


def test_a_try_keeps_a_lower_tier_to_its_share_of_the_capacity(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        policy = QueuePolicy(
            tiers=[QueueTier(name="interactive"), QueueTier(name="batch", capacity_share=0.5)], default_tier="batch"
        )
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=4)}, policy)
        client = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            batch = [(await tried(queue, client, model, "bulk", "batch"))[1] for _ in range(3)]
            assert [ticket is not None for ticket in batch] == [True, True, False]
            interactive = [(await tried(queue, client, model, "chat", "interactive"))[1] for _ in range(3)]
            assert [ticket is not None for ticket in interactive] == [True, True, False]
            for ticket in [*batch[:2], *interactive[:2]]:
                await ticket.release()
            assert (await queue.status(model))["in_flight"] == 0
        finally:
            await client.aclose()
            await queue.aclose()

    asyncio.run(scenario())


def test_an_admit_with_the_tokens_of_a_try_whose_answer_was_lost_takes_no_second_slot(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=2)})
        client = redis.asyncio.Redis.from_url(redis_server.url)
        keys = queue_keys(model, len(POLICY.tiers))
        try:
            attempt = queue.try_slot(model, "a")
            await run_together(client, [attempt.call])  # it took a slot; say its answer never came back
            ticket = await queue.acquire(model, "a", token=attempt.token)
            assert (ticket.slot_id, ticket.wait_s) == (attempt.token, 0.0)
            assert (await client.zcard(keys.inflight), await client.hget(keys.holders, "a")) == (1, b"1")
            await ticket.release()
            # A try forgotten by whoever sent it (its request failed before reading the answer)
            # gives its slot back; a busy one had none to give.
            lost = queue.try_slot(model, "a")
            await run_together(client, [lost.call])
            await queue.forget_try(lost)
            assert (await client.zcard(keys.inflight), await client.hlen(keys.holders)) == (0, 0)
        finally:
            await client.aclose()
            await queue.aclose()

    asyncio.run(scenario())


def test_an_unsaturated_request_costs_one_round_trip_to_admit_and_one_to_release(redis_server):
    async def scenario() -> list[str]:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()}, lease_s=120, heartbeat_s=50)
        try:
            await (await queue.acquire(model, "warm")).release()  # loads the script (EVALSHA, NOSCRIPT, EVAL)
            with monitored(redis_server.url) as commands:
                ticket = await queue.acquire(model, "a")
                admitted = list(commands)
                await ticket.release()
                await asyncio.sleep(0.2)  # MONITOR lines arrive asynchronously
            return admitted, list(commands)
        finally:
            await queue.aclose()

    admitted, total = asyncio.run(scenario())
    assert admitted == ["EVALSHA"] or admitted == [], admitted  # the monitor may lag; total is exact
    assert total == ["EVALSHA", "EVALSHA"], total


class monitored:
    """Commands clients send to Redis (not those scripts run), via MONITOR in a thread."""

    def __init__(self, url: str) -> None:
        self.url, self.commands = url, []

    def __enter__(self) -> list[str]:
        self._client = redis.Redis.from_url(self.url)
        self._monitor = self._client.monitor().__enter__()
        ready = threading.Event()

        def read() -> None:
            ready.set()
            try:
                while True:
                    event = self._monitor.next_command()
                    if event["client_type"] != "lua" and event["command"] != "MONITOR":
                        self.commands.append(event["command"].split()[0].upper())
            except (redis.RedisError, OSError, ValueError):  # the connection closed: done
                return

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()
        ready.wait()
        time.sleep(0.1)
        return self.commands

    def __exit__(self, *exc: object) -> None:
        self._monitor.connection.disconnect()
        self._thread.join(timeout=5)
        self._client.close()
