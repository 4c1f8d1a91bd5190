"""The work queue's turns, on a real redis-server: tenants with lines waiting take turns, then
their batches do; a batch leaves the rotation when its lines are all taken and comes back when
lines are enqueued again; a retired batch leaves no key behind; a dead worker's line is taken
over; lines an earlier version left in its single stream move to their batches."""

from __future__ import annotations

import asyncio

from serving.gateway.batch.store import (
    ACTIVE,
    LEGACY_STREAM,
    WORK_GROUP,
    WORK_TENANTS,
    BatchStore,
    tenant_work_key,
    work_key,
)
from serving.gateway.redis.client import redis_client


def lines(prefix: str, n: int) -> list[dict[str, str]]:
    return [{"custom_id": f"{prefix}-{i}", "at": "0", "len": "2"} for i in range(n)]


def test_tenants_take_turns_then_their_batches(redis_server) -> None:
    async def go() -> tuple[list[str], list[str], str, list[str], list[bool]]:
        client = redis_client(redis_server.url, decode_responses=True)
        try:
            store = BatchStore(client)
            await store.enqueue("a1", "acme", lines("a1", 3))  # acme's two batches come first
            await store.enqueue("a2", "acme", lines("a2", 3))
            await store.enqueue("b1", "globex", lines("b1", 4))
            order = []
            while (claimed := (await store.claim("w"))[0]) is not None:
                order.append(claimed[2]["custom_id"])
                await store.line_done(claimed[0], claimed[1])
            _, bell = await store.claim("w")
            left = [*await client.zrange(WORK_TENANTS, 0, -1), *await client.zrange(tenant_work_key("acme"), 0, -1)]
            await store.enqueue("a1", "acme", lines("again", 1))  # a redone enqueue: back in the rotation
            again = await store.claim("w")
            await store.retire("a1", "acme")
            await store.enqueue("a2", "acme", lines("late", 1))
            await store.retire("a2")  # tenant unknown: the next claim drops it from the rotation
            after = await store.claim("w")
            await store.retire("b1", "globex")
            gone = [bool(await client.exists(work_key(b))) for b in ("a1", "a2", "b1")]
            return order, left, bell, [again[0][2]["custom_id"] if again[0] else "", str(after[0])], gone
        finally:
            await client.aclose()

    order, left, bell, claimed_later, exists = asyncio.run(go())
    assert order == ["a1-0", "b1-0", "a2-0", "b1-1", "a1-1", "b1-2", "a2-1", "b1-3", "a1-2", "a2-2"]
    assert left == []  # a drained batch and tenant leave the rotation
    assert bell != "0-0"  # an idle worker waits for the bell's next entry after this one
    assert claimed_later == ["again-0", "None"]  # a retired batch's line never starts
    assert exists == [False, False, False]


def test_a_line_held_by_a_dead_worker_is_taken_over_from_its_batch_only(redis_server) -> None:
    async def go() -> tuple[tuple | None, tuple | None, int]:
        client = redis_client(redis_server.url, decode_responses=True)
        try:
            store = BatchStore(client)
            await store.enqueue("t1", "acme", lines("t1", 2))
            await store.enqueue("t2", "acme", lines("t2", 1))
            held, _ = await store.claim("dead")  # t1-0, never renewed
            assert held is not None
            fresh = await store.reclaim("heir", ["t1", "t2", "never-enqueued"], 60_000)  # within its lease
            taken = await store.reclaim("heir", ["never-enqueued", "t2", "t1"], 0)
            waiting = await store.lines_waiting("t1")
            pending = await client.xpending(work_key("t1"), WORK_GROUP)
            assert pending["consumers"] == [{"name": "heir", "pending": 1}]
            await store.retire("t1", "acme")
            await store.retire("t2", "acme")
            return fresh, taken, waiting
        finally:
            await client.aclose()

    fresh, taken, waiting = asyncio.run(go())
    assert fresh is None
    assert taken is not None and taken[0] == "t1" and taken[2]["custom_id"] == "t1-0"
    assert waiting == 1


def test_lines_left_in_the_single_stream_of_an_earlier_version_move_to_their_batches(redis_server) -> None:
    async def go() -> tuple[int, list[str], bool]:
        client = redis_client(redis_server.url, decode_responses=True)
        try:
            store = BatchStore(client)
            await client.sadd(ACTIVE, "old-running")  # "old-final" is no longer active: its line is dropped
            for batch_id, custom_id in (("old-running", "x"), ("old-final", "y"), ("old-running", "z")):
                await client.xadd(
                    LEGACY_STREAM, {"batch": batch_id, "tenant": "acme", "custom_id": custom_id, "body": "{}"}
                )
            moved = await store.adopt_legacy_lines("me")
            claimed = []
            while (line := (await store.claim("w"))[0]) is not None:
                claimed.append(f"{line[0]}/{line[2]['custom_id']}")
            left = bool(await client.exists(LEGACY_STREAM))
            await store.retire("old-running", "acme")
            return moved, claimed, left
        finally:
            await client.aclose()

    assert asyncio.run(go()) == (2, ["old-running/x", "old-running/z"], False)
