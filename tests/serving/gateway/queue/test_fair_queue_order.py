"""The fair queue's order against a real redis-server: capacity, weighted shares, an idle tenant
served next, tiers, and the reserve a flooding tenant leaves to lighter ones.

Ordering tests hold the model's only slot, queue requests behind it, then let each admitted
request release at once: capacity 1 admits strictly one at a time, so the order in which
requests are admitted is the order the Lua script chose. No test asserts a duration; deadlines
only bound a hang.
"""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio

from serving.gateway.config.queue_policy import QueuePolicy, QueueTier
from serving.gateway.queue.fair_queue import FairQueue, queue_keys
from tests.support.fair_queue import (
    HANG_BOUND_S,
    POLICY,
    RESERVED,
    admission_order,
    fresh_model,
    one_slot,
    opened,
    queued_at_least,
)
from tests.support.waiting import eventually_async


def test_admits_at_once_below_capacity_and_queues_at_it(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=2)})
        try:
            first, second = await queue.acquire(model, "a"), await queue.acquire(model, "a")
            assert (first.wait_s, second.wait_s) == (0.0, 0.0)
            waiting = asyncio.create_task(queue.acquire(model, "b"))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "a waiter")
            assert not waiting.done()
            await first.release()
            third = await asyncio.wait_for(waiting, HANG_BOUND_S)
            assert third.wait_s > 0
            status = await queue.status(model)
            assert (status["in_flight"], status["capacity"]) == (2, 2)
            await second.release()
            await third.release()
            await third.release()  # idempotent
            assert (await queue.status(model))["in_flight"] == 0
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_weights_two_to_one_share_a_backlog(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            # The heavy tenant's whole flood arrives first; the weights still decide the shares.
            arrivals = [("heavy", 2.0)] * 20 + [("light", 1.0)] * 20
            order = await admission_order(queue, model, arrivals)
            first_30 = order[:30]
            assert first_30.count("heavy") == 20 and first_30.count("light") == 10, first_30
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_equal_weights_alternate(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            order = await admission_order(queue, model, [("a", 1.0)] * 6 + [("b", 1.0)] * 6)
            assert order[:6].count("a") == 3, order
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_an_idle_tenant_is_served_next_not_behind_a_flood(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            order = await admission_order(queue, model, [("flood", 1.0)] * 15, late=[(5, "quiet")])
            # It arrived after 5 admissions, with 10 flood requests waiting: at most the flood's
            # head (queued at the same virtual time) goes before it.
            assert order.index("quiet") <= 6, order
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_higher_tiers_go_first(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            blocker = await queue.acquire(model, "x")
            order: list[str] = []

            async def one(tier: str) -> None:
                ticket = await queue.acquire(model, tier, tier=tier)
                order.append(tier)
                await ticket.release()

            tasks = []
            for n, tier in enumerate(["batch", "standard", "interactive"]):
                tasks.append(asyncio.create_task(one(tier)))
                await eventually_async(lambda n=n: queued_at_least(queue, model, n + 1), "queued")
            await blocker.release()
            await asyncio.wait_for(asyncio.gather(*tasks), HANG_BOUND_S)
            assert order == ["interactive", "standard", "batch"]
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_a_lower_tier_leaves_its_share_of_capacity_free_for_higher_ones(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        policy = QueuePolicy(
            tiers=[QueueTier(name="interactive"), QueueTier(name="batch", capacity_share=0.5)], default_tier="batch"
        )
        queue = FairQueue(
            redis_server.url, policy, {model: one_slot(max_ongoing_requests=4)}, lease_s=2, heartbeat_s=0.2
        )
        await queue.start()
        try:
            batch = [await queue.acquire(model, "bulk", tier="batch") for _ in range(2)]
            waiting = asyncio.create_task(queue.acquire(model, "bulk", tier="batch"))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "batch waiting at half the capacity")
            interactive = [await queue.acquire(model, "chat", tier="interactive") for _ in range(2)]
            assert all(t.wait_s == 0 for t in interactive)  # no slot had to free for them
            assert (await queue.status(model))["in_flight"] == 4
            for ticket in interactive:
                await ticket.release()
            assert (await queue.status(model))["queued"]["batch"] == 1  # freed slots beyond its share stay free
            await batch[0].release()  # batch below its share again: the waiter goes in
            for ticket in (batch[1], await asyncio.wait_for(waiting, HANG_BOUND_S)):
                await ticket.release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


async def _admitted_at_once(queue: FairQueue, model: str, tenant: str, tickets: list) -> asyncio.Task | None:
    """Acquire for `tenant` until a request has to wait; that one's task is returned, still waiting."""
    while True:
        task = asyncio.create_task(queue.acquire(model, tenant))
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if not done:
            return task
        tickets.append(task.result())


def test_a_flooding_tenant_leaves_the_reserve_to_a_lighter_one(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=8)}, RESERVED)
        try:
            flood: list = []
            flood_waiter = await _admitted_at_once(queue, model, "flood", flood)
            assert len(flood) == 6  # alone, it stops short of the reserve
            light = [await asyncio.wait_for(queue.acquire(model, "light"), 0.5) for _ in range(2)]
            assert [t.wait_s for t in light] == [0.0, 0.0]  # a saturated model, yet no wait
            light_waiter = asyncio.create_task(queue.acquire(model, "light"))
            await eventually_async(lambda: queued_at_least(queue, model, 2), "both tenants waiting")
            # A slot frees. The flood's waiter is ahead in the queue, but the flood holds more
            # than its share and only the reserve is free: the light tenant's request takes it.
            await flood.pop().release()
            light.append(await asyncio.wait_for(light_waiter, HANG_BOUND_S))
            assert not flood_waiter.done()
            # The light tenant leaves; the flood gets the model back, short of the reserve again.
            for ticket in light:
                await ticket.release()
            flood.append(await asyncio.wait_for(flood_waiter, HANG_BOUND_S))
            status = await queue.status(model)
            assert status["in_flight"] == 6
            for ticket in flood:
                await ticket.release()
            assert (await queue.status(model))["in_flight"] == 0
            client = redis.asyncio.Redis.from_url(redis_server.url)
            keys = queue_keys(model, len(RESERVED.tiers))
            assert (await client.hlen(keys.slots), await client.hlen(keys.holders)) == (0, 0)  # nobody looks busy
            await client.aclose()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_without_a_reserve_a_flooding_tenant_fills_every_slot(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        policy = QueuePolicy(tiers=POLICY.tiers, reserve_share=0, keepalive_s=0.05)
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=8)}, policy)
        try:
            flood: list = []
            waiter = await _admitted_at_once(queue, model, "flood", flood)
            assert len(flood) == 8
            waiter.cancel()
            for ticket in flood:
                await ticket.release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_on_a_saturated_model_a_freed_slot_goes_to_the_tenant_under_its_weighted_share(redis_server):
    """Every slot that frees on a saturated model is inside the reserve (capacity - 1 in flight), so
    the reserve's share decides it: by weight. Capacity 10 with the default reserve (1 slot); "a"
    and "b" weigh 1 and hold 3 each, "heavy" weighs 4 and holds 4. Shares of 10 by weight (6 in
    all): heavy 5 (its 4/6 held to half), a and b 1.67 each. Split equally (3.33 each), a would
    be under its share with 2 and take the slot, ahead of heavy; by weight it is over."""

    async def scenario() -> None:
        model = fresh_model()
        policy = QueuePolicy(tiers=POLICY.tiers, keepalive_s=0.05)  # reserve_share: the default 0.1
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=10)}, policy)
        weights = {"a": 1.0, "b": 1.0, "heavy": 4.0}
        try:
            held = {
                tenant: [await queue.acquire(model, tenant, weight=weights[tenant]) for _ in range(n)]
                for tenant, n in {"a": 3, "b": 3, "heavy": 4}.items()
            }
            assert all(t.wait_s == 0 for tickets in held.values() for t in tickets)
            a_waiter = asyncio.create_task(queue.acquire(model, "a", weight=1.0))  # first in the queue
            await eventually_async(lambda: queued_at_least(queue, model, 1), "a waits")
            heavy_waiter = asyncio.create_task(queue.acquire(model, "heavy", weight=4.0))
            await eventually_async(lambda: queued_at_least(queue, model, 2), "heavy waits behind it")
            await held["a"].pop().release()  # a holds 2: still over its weighted share
            held["heavy"].append(await asyncio.wait_for(heavy_waiter, HANG_BOUND_S))
            assert not a_waiter.done()
            await held["heavy"].pop().release()  # heavy back under its share, a still over: nobody
            assert (await queue.status(model))["in_flight"] == 9  # the reserve slot stays free
            await held["b"].pop().release()  # now 8 in flight, below the reserve: the head goes
            held["a"].append(await asyncio.wait_for(a_waiter, HANG_BOUND_S))
            for tickets in held.values():
                for ticket in tickets:
                    await ticket.release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_a_tenant_under_its_share_gets_the_reserve_however_deep_in_the_queue_it_waits(redis_server):
    """The reserve's slot goes to the first waiter whose tenant is under its share, wherever it
    waits. Capacity 8, reserve 2: "heavy" holds 6 and queues 40 more (start tags 0..39), "light"
    holds 2 and queues LIGHT more (tags 0.., each after heavy's of the same tag). Both weigh 1: a
    share of 4 each, so heavy is over it and light under. Each light release hands light's slot
    to light's next waiter, out of tag order, which moves the virtual time up past heavy's stale
    waiters: after 31 of them, light's next waiter has 32 of heavy's ahead of it.

    What broke it: the script looked for that waiter among the first 32 only, found none, and left
    the slot idle; the next release then fell below the reserve and gave the head, heavy's, a slot
    over its share."""
    light_waiters = 36

    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=8)}, RESERVED)
        pending: set[asyncio.Task] = set()
        try:
            heavy = [await queue.acquire(model, "heavy") for _ in range(6)]  # only the reserve left
            light = [await queue.acquire(model, "light") for _ in range(2)]  # under its share: the reserve
            assert all(t.wait_s == 0 for t in heavy + light)
            for tenant, n in (("heavy", 40), ("light", light_waiters)):
                for _ in range(n):
                    pending.add(asyncio.create_task(queue.acquire(model, tenant)))
                    await eventually_async(lambda: queued_at_least(queue, model, len(pending)), f"{tenant} waits")
            for handed in range(light_waiters):
                await light.pop(0).release()
                status = await queue.status(model)
                assert status["in_flight"] == 8, (handed, status)  # the slot went on at once, to light
                done, _ = await asyncio.wait(pending, timeout=HANG_BOUND_S, return_when=asyncio.FIRST_COMPLETED)
                (ticket,) = (task.result() for task in done)
                pending -= done
                assert ticket.tenant == "light", handed
                light.append(ticket)
            assert sum((await queue.status(model))["queued"].values()) == 40  # heavy's, all still waiting
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for ticket in heavy + light:
                await ticket.release()
        finally:
            for task in pending:
                task.cancel()
            await queue.aclose()

    asyncio.run(scenario())
