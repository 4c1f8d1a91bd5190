"""The memory the Batch API holds in one gateway process, counted in bytes against one budget.

Uploads, validations, finalizations and downloads hold file bytes in memory. They share
`gateway.batch.memory_bytes()` (what the pod's memory limit allows for them) instead of
taking turns behind one lock: a turn-taking lock let one client that sends its upload slowly
hold every other tenant's upload, validation and finalization on that process. Each holder
counts what it actually holds, as it holds it: an upload its bytes received so far (times
the copies parsing makes), a download the one chunk it is sending. So a slow sender or a slow
reader holds almost nothing, and many of them cannot add up to whole files.

An upload that would go over the budget is refused at once (503, retry): waiting would let a
client hold the bytes it already sent. Background steps (validation, finalization) and
download chunks wait for room instead: they hold nothing while they wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class MemoryBusy(RuntimeError):
    """The budget has no room for what was asked, now (an upload) or in time (a create)."""


class MemoryBudget:
    def __init__(self, total_bytes: int, on_change: Callable[[int], None] | None = None) -> None:
        self.total, self.held = total_bytes, 0
        self._freed = asyncio.Condition()
        self._on_change = on_change

    def try_take(self, size: int) -> bool:
        """Take `size` bytes if they fit now (a request larger than the whole budget never does)."""
        if self.held + size > self.total:
            return False
        self._set(self.held + size)
        return True

    async def take(self, size: int, wait_s: float | None = None) -> None:
        """Take `size` bytes, waiting for room (at most `wait_s`, then MemoryBusy). A request
        larger than the whole budget waits until nothing else is held, then takes it alone."""
        size = min(size, self.total)
        async with self._freed:
            try:
                async with asyncio.timeout(wait_s):
                    await self._freed.wait_for(lambda: self.held + size <= self.total)
            except TimeoutError:
                raise MemoryBusy(f"{size} bytes did not fit in {wait_s} s") from None
            self._set(self.held + size)

    def give(self, size: int) -> None:
        self._set(self.held - size)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._freed:
            self._freed.notify_all()

    @asynccontextmanager
    async def holding(self, size: int, wait_s: float | None = None) -> AsyncIterator[None]:
        size = min(size, self.total)
        await self.take(size, wait_s)
        try:
            yield
        finally:
            self.give(size)

    def _set(self, held: int) -> None:
        self.held = held
        if self._on_change is not None:
            self._on_change(held)


class Hold:
    """What one upload holds, grown as its bytes arrive and given back whole at the end."""

    def __init__(self, budget: MemoryBudget) -> None:
        self.budget, self.size = budget, 0

    def grow(self, size: int) -> bool:
        if not self.budget.try_take(size):
            return False
        self.size += size
        return True

    def release(self) -> None:
        if self.size:
            self.budget.give(self.size)
            self.size = 0
