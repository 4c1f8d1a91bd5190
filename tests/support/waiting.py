"""Waiting in tests for something another thread or process does: poll until it holds. The
deadline only bounds a hang (HANG_BOUND_S unless given); it is never a claim about speed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tests.support.servers import HANG_BOUND_S

T = TypeVar("T")


def eventually(check: Callable[[], T], what: str, bound_s: float = HANG_BOUND_S, poll_s: float = 0.02) -> T:
    """Call `check` until it returns something true, and return that; AssertionError naming
    `what` if it never does."""
    deadline = time.monotonic() + bound_s
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        time.sleep(poll_s)
    return result


async def eventually_async(
    check: Callable[[], Awaitable[T]], what: str, bound_s: float = HANG_BOUND_S, poll_s: float = 0.02
) -> T:
    """`eventually` for a coroutine check, without blocking the event loop."""
    deadline = time.monotonic() + bound_s
    while not (result := await check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
        await asyncio.sleep(poll_s)
    return result
