"""The gateway's Redis clients: bounded pools, short timeouts, no blind retries, and a busy pool
told apart from a Redis outage.

A burst of requests must not open a Redis connection each: hundreds of connects at once on
a busy replica take longer than the command timeout, so a burst would turn into 503s. Each
client keeps at most `MAX_CONNECTIONS`, and callers take one of that many permits first
(`GatedRedis.slot`), waiting at most `POOL_WAIT_S`.

A caller that cannot get a permit in time gets `RedisBusy`, never a Redis error: every
connection is busy answering other requests, which is load, not an outage. Callers answer it
with 503 + Retry-After, and never with what they do when Redis is down (the outage key cache,
per-replica limits), which would let a burst of load open a fresh local limiter per replica or
accept a key revoked minutes ago.

No automatic retries: a command retried after a timeout may have run already, and a
limiter script that ran twice charges twice. The callers decide what a failure means.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

MAX_CONNECTIONS = 32
TIMEOUT_S = 2.0  # connect and each command
POOL_WAIT_S = 2.0  # the wait for a free connection (a burst of requests queues here)


def is_out_of_memory(exc: BaseException) -> bool:
    """Redis refused a write because it reached maxmemory (`OOM command not allowed ...`), a
    script's included: with `maxmemory-policy noeviction` it refuses rather than evicts.
    redis-py turns the OOM reply into OutOfMemoryError (dropping the prefix); a pipeline's
    failed command arrives wrapped in its own message, so the text is read too."""
    from redis.exceptions import OutOfMemoryError, ResponseError

    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "command not allowed when used memory > 'maxmemory'" in str(exc)
    )


def raise_if_cancel_was_lost() -> None:
    """Raise CancelledError when the running task was asked to stop (`Task.cancel`) but a Redis
    call ate the request. On Python 3.11 redis-py sends each command under `asyncio.wait_for`,
    which returns the command's result when the command ends just as the cancel lands
    (python/cpython#86296, fixed in 3.12); the task still counts the request (`cancelling()`).
    A loop of Redis calls that does not look would run on, and whoever awaits it to stop
    (a lifespan shutdown) would wait forever. Call it between the steps of such a loop."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_loops(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel background loops and wait until each has ended. Not `await task` under
    suppress(CancelledError): that would also swallow a cancel of the caller's own (a shutdown's
    deadline), leaving it no way to stop waiting. A loop that ended on an error has it read here,
    so it is not reported again as never retrieved."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()


class RedisBusy(RuntimeError):
    """Every pooled connection stayed in use for POOL_WAIT_S: the gateway is loaded, Redis is up."""


def redis_client(url: str, *, decode_responses: bool = False, max_connections: int | None = None) -> Any:
    import redis.asyncio as redis  # here, so the in-memory key store needs no redis package
    from redis.asyncio.retry import Retry  # the asyncio client warns on (and converts) the sync one
    from redis.backoff import NoBackoff

    pool = redis.BlockingConnectionPool.from_url(
        url,
        max_connections=max_connections or MAX_CONNECTIONS,
        timeout=TIMEOUT_S,
        socket_timeout=TIMEOUT_S,
        socket_connect_timeout=TIMEOUT_S,
        decode_responses=decode_responses,
        retry=Retry(NoBackoff(), 0),
    )
    # The URL picks the class (TCP, TLS for rediss://, unix socket); only its packer changes.
    # A class is hashable; mypy reads `type[X].__hash__` as X's unbound method and says it is not.
    pool.connection_class = packed_by_hiredis(pool.connection_class)  # type: ignore[arg-type]
    return redis.Redis(connection_pool=pool)


@cache
def packed_by_hiredis(connection_class: type) -> type:
    """`connection_class` with commands packed by hiredis (C) instead of redis-py's asyncio
    packer, which joins the growing command once per argument in Python: the limiter scripts
    send thirty-odd keys and arguments per call. redis-py's own synchronous client packs with
    hiredis whenever it is installed (redis.connection.HiredisRespSerializer); its asyncio
    client does not. Without hiredis, the class is returned unchanged."""
    try:
        import hiredis
    except ImportError:
        return connection_class
    from redis.exceptions import DataError

    def pack_command(self: Any, *args: Any) -> list[bytes]:
        # As redis-py does: a command name with a space ("SCRIPT LOAD") goes out as two words.
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            pass
        # hiredis takes no buffers: copied here, off the common path
        copied: tuple[Any, ...] = tuple(bytes(a) if isinstance(a, bytearray | memoryview) else a for a in args)
        try:
            return [hiredis.pack_command(copied)]
        except TypeError as exc:  # bool, None, ...: refused, as redis-py's encoder refuses them
            raise DataError(str(exc)) from exc

    return type(f"Hiredis{connection_class.__name__}", (connection_class,), {"pack_command": pack_command})


class GatedRedis:
    """A Redis client whose callers queue for a permit (one per pooled connection) instead of
    inside the pool, so a full pool surfaces as `RedisBusy`."""

    def __init__(self, url: str, *, decode_responses: bool = False) -> None:
        self._size = MAX_CONNECTIONS  # read now, so a test can shrink the pool before making a client
        self.redis = redis_client(url, decode_responses=decode_responses, max_connections=self._size)
        self._permits = asyncio.Semaphore(self._size)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[Any]:
        await self._acquire()
        try:
            yield self.redis
        finally:
            self._permits.release()

    async def _acquire(self) -> None:
        if not self._permits.locked():
            await self._permits.acquire()  # a free permit: taken at once, no timer to arm and cancel
            return
        try:
            async with asyncio.timeout(POOL_WAIT_S):
                await self._permits.acquire()
        except TimeoutError:
            raise RedisBusy(f"all {self._size} Redis connections busy for {POOL_WAIT_S} s") from None

    async def aclose(self) -> None:
        await self.redis.aclose()


@dataclass
class ScriptCall:
    """One run of a Lua script, to send alone (`run`) or in one round trip with others
    (`run_together`). After `run_together`, `sent` says whether Redis answered the pipeline and
    `result` holds the script's reply, or the exception it raised."""

    script: Any  # a redis-py Script: its sha, and its own client for a lone run
    keys: Sequence[Any]
    args: Sequence[Any]
    sent: bool = False
    result: Any = None

    async def run(self) -> Any:
        return await self.script(keys=self.keys, args=self.args)


async def run_together(redis: Any, calls: Sequence[ScriptCall]) -> None:
    """Send `calls` in one round trip: a pipeline without MULTI on one connection, so each
    script is atomic on its own and may touch keys of its own hash slot only (the gateway talks
    to one Redis node; a cluster client would split the pipeline by node). Each call's reply, or
    its error, lands in the call. EVALSHA goes out directly: redis-py's pipelined scripts would
    first ask `SCRIPT EXISTS`, a round trip of its own. A call Redis answered NOSCRIPT to (after
    a Redis restart) did not run, so it runs again alone, which loads the script. When the
    pipeline itself fails, the exception propagates and no call is marked sent: whether each
    ran is unknown."""
    from redis.exceptions import NoScriptError

    pipe = redis.pipeline(transaction=False)
    for call in calls:
        pipe.execute_command("EVALSHA", call.script.sha, len(call.keys), *call.keys, *call.args)
    async with pipe:
        results = await pipe.execute(raise_on_error=False)
    for call, result in zip(calls, results):
        call.sent, call.result = True, result
        if isinstance(result, NoScriptError):
            try:
                call.result = await call.run()
            except Exception as exc:  # noqa: BLE001 - kept for the call's owner, like a pipelined error
                call.result = exc
