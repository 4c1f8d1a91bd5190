"""The fair queue against a real redis-server: capacity across processes, weighted shares, an idle
tenant served next, dead waiters reclaimed, refusals, one round trip when unsaturated.

Ordering tests hold the model's only slot, queue requests behind it, then let each admitted
request release at once: capacity 1 admits strictly one at a time, so the order in which
requests are admitted is the order the Lua script chose. No test asserts a duration; deadlines
only bound a hang.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest
import redis
import redis.asyncio

from serving.gateway.fair_queue import FairQueue, QueueRefused, queue_keys
from serving.gateway.queue_policy import ModelQueue, QueuePolicy, QueueTier
from serving.gateway.redis_client import run_together

HANG_BOUND_S = 30
POLICY = QueuePolicy(tiers=[QueueTier(name="interactive", queue_timeout_s=HANG_BOUND_S),
                            QueueTier(name="standard", queue_timeout_s=HANG_BOUND_S),
                            QueueTier(name="batch", max_queue_length=3, queue_timeout_s=HANG_BOUND_S)],
                     keepalive_s=0.05)
_models = iter(range(10_000))


def fresh_model() -> str:
    """Each test its own model name: its own Redis keys in the module's shared redis-server."""
    return f"m{next(_models)}"


def one_slot(**overrides: object) -> ModelQueue:
    return ModelQueue(**{"max_ongoing_requests": 1, "max_replicas": 1, **overrides})


async def opened(url: str, models: dict[str, ModelQueue], policy: QueuePolicy = POLICY, **options: float
                 ) -> FairQueue:
    queue = FairQueue(url, policy, models, **{"lease_s": 2.0, "heartbeat_s": 0.2, **options})
    await queue.start()
    return queue


async def until(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_BOUND_S
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.02)


async def admission_order(queue: FairQueue, model: str, arrivals: list[tuple[str, float]],
                          late: list[tuple[int, str]] = ()) -> list[str]:
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
                await until(lambda: _queued(queue, model, len(arrivals) + len(late) - len(order)), "late arrival")
        await ticket.release()

    tasks = []
    for tenant, weight in arrivals:
        tasks.append(asyncio.create_task(one(tenant, weight)))
        await until(lambda: _queued(queue, model, len(tasks)), "queued arrivals")  # arrival order is fixed
    await blocker.release()
    while len(order) < len(arrivals) + len(late):
        await asyncio.wait_for(asyncio.gather(*list(tasks)), HANG_BOUND_S)
    return order


async def _queued(queue: FairQueue, model: str, n: int) -> bool:
    return sum((await queue.status(model))["queued"].values()) >= n


def test_admits_at_once_below_capacity_and_queues_at_it(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=2)})
        try:
            first, second = await queue.acquire(model, "a"), await queue.acquire(model, "a")
            assert (first.wait_s, second.wait_s) == (0.0, 0.0)
            waiting = asyncio.create_task(queue.acquire(model, "b"))
            await until(lambda: _queued(queue, model, 1), "a waiter")
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
                await until(lambda n=n: _queued(queue, model, n + 1), "queued")
            await blocker.release()
            await asyncio.wait_for(asyncio.gather(*tasks), HANG_BOUND_S)
            assert order == ["interactive", "standard", "batch"]
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_a_lower_tier_leaves_its_share_of_capacity_free_for_higher_ones(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        policy = QueuePolicy(tiers=[QueueTier(name="interactive"), QueueTier(name="batch", capacity_share=0.5)],
                             default_tier="batch")
        queue = FairQueue(redis_server.url, policy, {model: one_slot(max_ongoing_requests=4)}, lease_s=2,
                          heartbeat_s=0.2)
        await queue.start()
        try:
            batch = [await queue.acquire(model, "bulk", tier="batch") for _ in range(2)]
            waiting = asyncio.create_task(queue.acquire(model, "bulk", tier="batch"))
            await until(lambda: _queued(queue, model, 1), "batch waiting at half the capacity")
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


RESERVED = QueuePolicy(tiers=POLICY.tiers, reserve_share=0.25, keepalive_s=0.05)  # 2 of 8 slots


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
            await until(lambda: _queued(queue, model, 2), "both tenants waiting")
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


def test_timeouts_refuse_with_429_for_the_tenants_own_backlog_and_503_otherwise(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot()})
        loop = asyncio.get_running_loop()
        try:
            blocker = await queue.acquire(model, "x")
            patient = asyncio.create_task(queue.acquire(model, "flood", deadline=loop.time() + HANG_BOUND_S))
            await until(lambda: _queued(queue, model, 1), "queued")
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
                await until(lambda n=n: _queued(queue, model, n + 1), "queued")
            with pytest.raises(QueueRefused) as over:
                await queue.acquire(model, "flood", tier="batch")
            assert (over.value.refusal.status, over.value.refusal.reason) == (429, "queue_full")
            quiet = asyncio.create_task(queue.acquire(model, "quiet", tier="batch"))
            with pytest.raises(QueueRefused) as pushed:
                await asyncio.wait_for(flood[2], HANG_BOUND_S)
            assert (pushed.value.refusal.status, pushed.value.refusal.reason) == (429, "pushed_out")
            await until(lambda: _queued(queue, model, 3), "the quiet tenant queued")
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
            await until(lambda: _queued(queue, model, 1), "queued")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await until(lambda: _no_waiters(queue, model), "the cancelled waiter gone")
            await blocker.release()
            assert (await queue.status(model))["in_flight"] == 0
        finally:
            await queue.aclose()

    asyncio.run(scenario())


async def _no_waiters(queue: FairQueue, model: str) -> bool:
    return sum((await queue.status(model))["queued"].values()) == 0


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
            await until(lambda: _queued(queue, model, 1), "queued")
            await blocker.release()
            await (await asyncio.wait_for(waiting, HANG_BOUND_S)).release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


def test_live_replicas_set_the_capacity_and_zero_replicas_mean_a_cold_start(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: ModelQueue(max_ongoing_requests=2, min_replicas=0,
                                                                  max_replicas=3)})
        try:
            assert (await queue.status(model))["capacity"] == 6  # nobody published: max_replicas
            first = await queue.acquire(model, "a")
            assert first.cold  # min_replicas 0 and no live count: it may be cold
            await queue.set_replicas(model, 0, valid_s=60)
            status = await queue.status(model)
            assert (status["capacity"], status["live_replicas"]) == (2, 0)  # one replica's worth wakes Serve
            second = await queue.acquire(model, "a")
            waiting = asyncio.create_task(queue.acquire(model, "a"))
            await until(lambda: _queued(queue, model, 1), "queued at zero replicas")
            await queue.set_replicas(model, 2, valid_s=60)  # scaled up: the waiter is admitted at once
            third = await asyncio.wait_for(waiting, HANG_BOUND_S)
            assert not third.cold
            for ticket in (first, second, third):
                await ticket.release()
        finally:
            await queue.aclose()

    asyncio.run(scenario())


# --- a try for a free slot, sent in another client's round trip (the limiter's admit) ------------


async def tried(queue: FairQueue, client, model: str, tenant: str, tier: str | None = None):
    """(the try, the ticket it took or None), sent in a pipeline as the limiter sends it."""
    attempt = queue.try_slot(model, tenant, tier=tier)
    await run_together(client, [attempt.call])
    return attempt, queue.tried(attempt)


async def snapshot(client, model: str, tiers: int) -> dict:
    """Every key of the model's queue, as Redis holds it."""
    read = {b"hash": client.hgetall, b"zset": lambda name: client.zrange(name, 0, -1, withscores=True),
            b"string": client.get}
    out = {}
    for name in queue_keys(model, tiers).script_keys():
        kind = await client.type(name)
        out[name] = await read[kind](name) if kind in read else None
    return out


def test_a_try_takes_a_free_slot_by_the_admits_rule_and_answers_busy_without_queueing(redis_server):
    async def scenario() -> None:
        model = fresh_model()
        queue = await opened(redis_server.url, {model: one_slot(max_ongoing_requests=8)}, RESERVED,
                             lease_s=120, heartbeat_s=50)  # no lease renewal moves a score mid-test
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
            await until(lambda: _queued(queue, model, 1), "the flood waiting")
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
            await until(lambda: _queued(queue, model, 3), "the batch queue full")
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
        policy = QueuePolicy(tiers=[QueueTier(name="interactive"), QueueTier(name="batch", capacity_share=0.5)],
                             default_tier="batch")
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


# --- several processes -------------------------------------------------------------------------

PROBE = "fq-test:holders"


def _hammer(url: str, model: str, rounds: int, concurrency: int, capacity: int) -> None:
    """One gateway process: `concurrency` callers acquire, count themselves in an independent Redis
    counter while holding the slot, and release, `rounds` times each."""
    async def main() -> None:
        queue = FairQueue(url, POLICY, {model: ModelQueue(max_ongoing_requests=capacity)},
                          lease_s=10, heartbeat_s=1)
        await queue.start()
        probe = redis.asyncio.Redis.from_url(url)
        try:
            async def caller(n: int) -> None:
                for _ in range(rounds):
                    async with queue.slot(model, f"t{n % 3}", weight=1 + n % 2):
                        holders = await probe.incr(PROBE)
                        await probe.eval("if tonumber(ARGV[1]) > tonumber(redis.call('GET', KEYS[1]) or '0') then "
                                         "redis.call('SET', KEYS[1], ARGV[1]) end", 1, f"{PROBE}:peak", holders)
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
