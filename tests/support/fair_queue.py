"""The fair queue's test helpers: a queue policy with three tiers, a fresh model name per test
(its own Redis keys in the module's shared redis-server), and the admission-order harness."""

from __future__ import annotations

import asyncio

from serving.gateway.config.queue_policy import ModelQueue, QueuePolicy, QueueTier
from serving.gateway.queue.fair_queue import FairQueue
from tests.support.waiting import eventually_async

HANG_BOUND_S = 30
POLICY = QueuePolicy(
    tiers=[
        QueueTier(name="interactive", queue_timeout_s=HANG_BOUND_S),
        QueueTier(name="standard", queue_timeout_s=HANG_BOUND_S),
        QueueTier(name="batch", max_queue_length=3, queue_timeout_s=HANG_BOUND_S),
    ],
    keepalive_s=0.05,
)
RESERVED = QueuePolicy(tiers=POLICY.tiers, reserve_share=0.25, keepalive_s=0.05)  # 2 of 8 slots
_models = iter(range(10_000))


def fresh_model() -> str:
    """Each test its own model name: its own Redis keys in the module's shared redis-server."""
    return f"m{next(_models)}"


def one_slot(**overrides: object) -> ModelQueue:
    return ModelQueue(**{"max_ongoing_requests": 1, "max_replicas": 1, **overrides})


async def opened(url: str, models: dict[str, ModelQueue], policy: QueuePolicy = POLICY, **options: float) -> FairQueue:
    queue = FairQueue(url, policy, models, **{"lease_s": 2.0, "heartbeat_s": 0.2, **options})
    await queue.start()
    return queue


async def admission_order(
    queue: FairQueue, model: str, arrivals: list[tuple[str, float]], late: list[tuple[int, str]] = ()
) -> list[str]:
    """Queue `arrivals` (tenant, weight) behind a held slot, release it, and return the tenants in
    the order they were admitted. `late`: (after that many admissions, tenant) arriving mid-way."""
    order: list[str] = []
    blocker = await queue.acquire(model, "blocker")

    async def one(tenant: str, weight: float) -> None:
        ticket = await queue.acquire(model, tenant, weight=weight)
        order.append(tenant)
        for after, late_tenant in late:
            if len(order) == after:  # arrives while the flood is still queued, before the next release
                tasks.append(asyncio.create_task(one(late_tenant, 1.0)))
                await eventually_async(
                    lambda: queued_at_least(queue, model, len(arrivals) + len(late) - len(order)), "late arrival"
                )
        await ticket.release()

    tasks = []
    for tenant, weight in arrivals:
        tasks.append(asyncio.create_task(one(tenant, weight)))
        # one at a time: the arrival order is fixed
        await eventually_async(lambda: queued_at_least(queue, model, len(tasks)), "queued arrivals")
    await blocker.release()
    while len(order) < len(arrivals) + len(late):
        await asyncio.wait_for(asyncio.gather(*list(tasks)), HANG_BOUND_S)
    return order


async def queued_at_least(queue: FairQueue, model: str, n: int) -> bool:
    return sum((await queue.status(model))["queued"].values()) >= n


async def no_waiters(queue: FairQueue, model: str) -> bool:
    return sum((await queue.status(model))["queued"].values()) == 0
