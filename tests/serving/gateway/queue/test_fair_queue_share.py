"""The tenant's share the fair queue answers with each slot (fair_queue.lua `share_of`), against a
real redis-server and a model of it in Python: the slots the tenant holds, the tenants holding
slots and the sum of their weights, whichever way the slot was taken (a free slot at once, the
limiter's try, or a waiter woken by a release). The engine priority is derived from it by a pure
function (serving.gateway.capacity.engine_priority, tests/serving/gateway/capacity)."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis.asyncio

from serving.gateway.config.queue_policy import QueuePolicy
from serving.gateway.queue.fair_queue import QueueKeys, QueueTicket, TenantShare, queue_keys
from serving.gateway.redis.client import run_together
from tests.support.fair_queue import POLICY, fresh_model, one_slot, opened, queued_at_least
from tests.support.waiting import eventually_async

NO_RESERVE = QueuePolicy(tiers=POLICY.tiers, reserve_share=0, keepalive_s=0.05)  # every free slot is free to all
WEIGHTS = {"a": 1.0, "b": 3.0, "c": 0.5, "d": 2.0}


def expected(held: dict[str, int], tenant: str, capacity: int) -> TenantShare:
    holding = [t for t, n in held.items() if n > 0]
    return TenantShare(held[tenant], len(holding), sum(WEIGHTS[t] for t in holding), capacity)


@pytest.mark.parametrize("seed", range(4))
def test_each_slot_comes_with_the_tenants_share_as_the_model_counts_it(redis_server, seed):
    rng = random.Random(seed)
    capacity = 12

    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=capacity)}, NO_RESERVE)
        client = redis.asyncio.Redis.from_url(redis_server.url)
        held: dict[str, int] = dict.fromkeys(WEIGHTS, 0)
        tickets: list[QueueTicket] = []
        try:
            for _ in range(60):
                if tickets and (len(tickets) == capacity or rng.random() < 0.4):
                    ticket = tickets.pop(rng.randrange(len(tickets)))
                    await ticket.release()
                    held[ticket.tenant] -= 1
                    continue
                tenant = rng.choice(list(WEIGHTS))
                if rng.random() < 0.5:  # the limiter's try, in its round trip
                    attempt = queue.try_slot(model, tenant, weight=WEIGHTS[tenant])
                    await run_together(client, [attempt.call])
                    taken = queue.tried(attempt)
                else:
                    taken = await queue.acquire(model, tenant, weight=WEIGHTS[tenant])
                assert taken is not None and taken.wait_s == 0
                held[tenant] += 1
                tickets.append(taken)
                assert taken.share == expected(held, tenant, capacity)
            for ticket in tickets:
                await ticket.release()
            # Tenants that hold nothing leave no weight behind.
            keys = queue_keys_of(model)
            assert await client.hlen(keys.weights) == 0 and await client.hlen(keys.holders) == 0
        finally:
            await client.aclose()
            await queue.aclose()

    asyncio.run(scenario())


def queue_keys_of(model: str) -> QueueKeys:
    return queue_keys(model, len(NO_RESERVE.tiers))


def test_a_waiter_woken_by_a_release_learns_its_share_from_the_wake_up(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        # A heartbeat far off: the waiter learns its admission from the wake-up, not a lease renewal.
        queue = await opened(
            redis_server.url, {model: one_slot(max_ongoing_requests=3)}, NO_RESERVE, heartbeat_s=10, lease_s=60
        )
        try:
            a_first = await queue.acquire(model, "a", weight=WEIGHTS["a"])
            a_second = await queue.acquire(model, "a", weight=WEIGHTS["a"])
            c_slot = await queue.acquire(model, "c", weight=WEIGHTS["c"])
            waiting = asyncio.create_task(queue.acquire(model, "b", weight=WEIGHTS["b"]))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "b waiting")
            await a_first.release()
            woken = await asyncio.wait_for(waiting, 30)
            assert woken.wait_s > 0  # it did wait: admitted by the release's promote, told by pub/sub
            # a holds 1, c 1, b 1 now: three tenants weighing 1 + 0.5 + 3.
            assert woken.share == TenantShare(held=1, holders=3, weights=4.5, capacity=3)
            for ticket in (a_second, c_slot, woken):
                await ticket.release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())
