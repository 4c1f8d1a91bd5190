"""The fair queue's waiters against a real redis-server: timeouts and their refusals, a full
queue, keep-alives, cancelled and lost waiters, and live replica counts. Deadlines only bound a hang."""

from __future__ import annotations

import asyncio

import pytest

from serving.gateway.config.queue_policy import ModelQueue
from serving.gateway.queue.fair_queue import QueueRefused
from tests.support.fair_queue import (
    HANG_BOUND_S,
    fresh_model,
    no_waiters,
    one_slot,
    opened,
    queued_at_least,
)
from tests.support.waiting import eventually_async


def test_timeouts_refuse_with_429_for_the_tenants_own_backlog_and_503_otherwise(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        loop = asyncio.get_running_loop()
        try:
            blocker = await queue.acquire(model, "x")
            patient = asyncio.create_task(queue.acquire(model, "flood", deadline=loop.time() + HANG_BOUND_S))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "queued")
            with pytest.raises(QueueRefused) as own:
                await queue.acquire(model, "flood", deadline=loop.time() + 0.2)
            assert (own.value.refusal.status, own.value.refusal.reason) == (429, "timeout")
            assert own.value.refusal.retry_after_s >= 1
            with pytest.raises(QueueRefused) as saturated:
                await queue.acquire(model, "quiet", deadline=loop.time() + 0.2)
            assert (saturated.value.refusal.status, saturated.value.refusal.code) == (503, "model_saturated")
            await blocker.release()
            await (await asyncio.wait_for(patient, HANG_BOUND_S)).release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_a_full_queue_keeps_the_fairest_waiters(redis_server):
    """Batch holds 3 waiters. A flood fills it; the flood's next request is refused (429); a
    quiet tenant takes the place of the flood's last waiter (pushed out: 429); once the queue
    holds only requests at the quiet tenant's virtual time, a newcomer gets 503."""

    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            blocker = await queue.acquire(model, "x")
            flood = []
            for n in range(3):
                flood.append(asyncio.create_task(queue.acquire(model, "flood", tier="batch")))
                await eventually_async(lambda n=n: queued_at_least(queue, model, n + 1), "queued")
            with pytest.raises(QueueRefused) as over:
                await queue.acquire(model, "flood", tier="batch")
            assert (over.value.refusal.status, over.value.refusal.reason) == (429, "queue_full")
            quiet = asyncio.create_task(queue.acquire(model, "quiet", tier="batch"))
            with pytest.raises(QueueRefused) as pushed:
                await asyncio.wait_for(flood[2], HANG_BOUND_S)
            assert (pushed.value.refusal.status, pushed.value.refusal.reason) == (429, "pushed_out")
            await eventually_async(lambda: queued_at_least(queue, model, 3), "the quiet tenant queued")
            # Now flood (tags 0 and 1) and quiet (tag 0): flood's second is furthest ahead.
            third = asyncio.create_task(queue.acquire(model, "third", tier="batch"))
            with pytest.raises(QueueRefused):
                await asyncio.wait_for(flood[1], HANG_BOUND_S)
            with pytest.raises(QueueRefused) as saturated:
                await queue.acquire(model, "fourth", tier="batch")
            assert (saturated.value.refusal.status, saturated.value.refusal.reason) == (503, "queue_full")
            await blocker.release()
            for task in (flood[0], quiet, third):
                await (await asyncio.wait_for(task, HANG_BOUND_S)).release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_keepalive_hook_runs_while_waiting_and_a_failing_hook_gives_up_the_place(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            blocker = await queue.acquire(model, "x")
            beats: list[float] = []

            async def client_gone(waited: float) -> None:
                beats.append(waited)
                if len(beats) == 3:
                    raise ConnectionResetError("client disconnected")

            with pytest.raises(ConnectionResetError):
                await queue.acquire(model, "a", on_wait=client_gone)
            assert len(beats) == 3 and beats == sorted(beats)
            assert sum((await queue.status(model))["queued"].values()) == 0
            await blocker.release()
            assert (await queue.status(model))["in_flight"] == 0
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_the_queue(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            blocker = await queue.acquire(model, "x")
            waiting = asyncio.create_task(queue.acquire(model, "a"))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "queued")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await eventually_async(lambda: no_waiters(queue, model), "the cancelled waiter gone")
            await blocker.release()
            assert (await queue.status(model))["in_flight"] == 0
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_a_lost_wake_up_is_caught_by_the_heartbeat(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        try:
            [listener] = [task for task in queue._tasks if task.get_name() == "fair-queue-listener"]
            listener.cancel()  # every wake-up message is now lost; only the heartbeat is left
            await asyncio.wait([listener])
            assert [t.get_name() for t in queue._tasks if not t.done()] == ["fair-queue-heartbeat"]
            blocker = await queue.acquire(model, "x")
            waiting = asyncio.create_task(queue.acquire(model, "a"))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "queued")
            await blocker.release()
            await (await asyncio.wait_for(waiting, HANG_BOUND_S)).release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_live_replicas_set_the_capacity_and_zero_replicas_mean_a_cold_start(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(
            redis_server.url, {model: ModelQueue(max_ongoing_requests=2, min_replicas=0, max_replicas=3)}
        )
        try:
            assert (await queue.status(model))["capacity"] == 6  # nobody published: max_replicas
            first = await queue.acquire(model, "a")
            assert first.cold  # min_replicas 0 and no live count: it may be cold
            await queue.set_replicas(model, 0, valid_s=60)
            status = await queue.status(model)
            assert (status["capacity"], status["live_replicas"]) == (2, 0)  # one replica's worth wakes Serve
            second = await queue.acquire(model, "a")
            waiting = asyncio.create_task(queue.acquire(model, "a"))
            await eventually_async(lambda: queued_at_least(queue, model, 1), "queued at zero replicas")
            await queue.set_replicas(model, 2, valid_s=60)  # scaled up: the waiter is admitted at once
            third = await asyncio.wait_for(waiting, HANG_BOUND_S)
            assert not third.cold
            for ticket in (first, second, third):
                await ticket.release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())
