"""Start and shut down a gateway app's lifespan many times, and report the background loops a
shutdown left running: how tests see a loop outlive the gateway when its cancel was lost (on
Python 3.11 a Redis call can swallow one, see serving.gateway.redis.client.raise_if_cancel_was_lost).
Many short lives, so some cancels land in the middle of a call."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tests.support.servers import HANG_BOUND_S

LIVES = 30


def loops_left_after_shutdowns(
    make_api: Callable[[], Any],
    loop_names: set[str],
    *,
    on_started: Callable[[set[str]], Awaitable[None]] | None = None,
) -> list[str]:
    """Run LIVES lifespans of `make_api()`, each shut down after 0-40 ms; the first shutdown that
    leaves a task whose coroutine's __qualname__ is in `loop_names` running gives those tasks
    (reprs), else []. `on_started(running names)` runs once each startup has completed."""

    def loops() -> set[asyncio.Task]:
        return {t for t in asyncio.all_tasks() if t.get_coro().__qualname__ in loop_names}

    async def one_life(lifetime_s: float) -> list[str]:
        to_app: asyncio.Queue[dict] = asyncio.Queue()
        from_app: asyncio.Queue[dict] = asyncio.Queue()
        lifespan = asyncio.create_task(
            make_api()({"type": "lifespan", "asgi": {"version": "3.0"}}, to_app.get, from_app.put)
        )
        await to_app.put({"type": "lifespan.startup"})
        assert (await asyncio.wait_for(from_app.get(), HANG_BOUND_S))["type"] == "lifespan.startup.complete"
        if on_started is not None:
            await on_started({t.get_coro().__qualname__ for t in loops()})
        await asyncio.sleep(lifetime_s)
        await to_app.put({"type": "lifespan.shutdown"})
        await asyncio.wait([lifespan], timeout=HANG_BOUND_S)  # only bounds a hang; cancels nothing
        left = [repr(task) for task in loops()]
        deadline = time.monotonic() + HANG_BOUND_S
        while (running := loops()) and time.monotonic() < deadline:  # the test's own cleanup
            for task in running:
                task.cancel()  # again, until each has ended
            await asyncio.sleep(0.01)
        await asyncio.wait([lifespan], timeout=HANG_BOUND_S)
        return left

    async def lives() -> list[str]:
        for n in range(LIVES):
            if left := await one_life(0.01 * (n % 5)):
                return left
        return []

    return asyncio.run(lives())
