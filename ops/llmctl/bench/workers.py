"""Client processes for `llmctl bench`: each sends its part of a level (`ops.llmctl.bench.split`)
with its own `AsyncOpenAI` client, so the load is not held back by one process's CPU.

A worker is `python -m ops.llmctl.bench.workers` (the name `--cpu-layers` counts as the
client), alive for the whole run, speaking JSON lines:
  stdin   a `Job` per level, then, once every worker is `Ready`, a `Go` with the instant to
          start at (the machine's monotonic clock, which all processes share)
  stdout  `Ready` when its client is built, a `Result` per request as it ends, then `Done`
It ends when its stdin closes. Anything else the worker prints goes to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Annotated, Literal

from pydantic import BaseModel, Field, TypeAdapter

from ops.llmctl.bench.loadgen import LevelPart, LoadSpec, make_client, run_level
from ops.llmctl.bench.split import merge_results, split_level
from ops.llmctl.bench.stats import RequestResult

# Between the last `Ready` and the start: long enough for every worker to read its `Go`.
START_MARGIN_S = 0.05
# A result line holds every chunk's arrival time; a job line every arrival of an open loop.
LINE_LIMIT = 64 * 1024 * 1024
EXIT_WAIT_S = 10


class Job(BaseModel):
    kind: Literal["job"] = "job"
    spec: LoadSpec
    mode: Literal["concurrency", "rate"]
    level: float
    part: LevelPart


class Go(BaseModel):
    kind: Literal["go"] = "go"
    start_at: float


class Ready(BaseModel):
    kind: Literal["ready"] = "ready"


class Result(BaseModel):
    kind: Literal["result"] = "result"
    result: RequestResult


class Done(BaseModel):
    kind: Literal["done"] = "done"


WorkerLine: TypeAdapter[Ready | Result | Done] = TypeAdapter(
    Annotated[Ready | Result | Done, Field(discriminator="kind")]
)


class WorkerDied(Exception):
    """A worker process ended in the middle of a level (its traceback is on stderr)."""


class WorkerPool:
    """`processes` workers for the length of a run: `async with WorkerPool(4) as pool`, then
    `await pool.run_level(...)` per level."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._workers: list[asyncio.subprocess.Process] = []

    async def __aenter__(self) -> WorkerPool:
        for _ in range(self.processes):
            self._workers.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "ops.llmctl.bench.workers",
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    limit=LINE_LIMIT,
                    start_new_session=True,  # Ctrl-C reaches llmctl alone, which ends them
                )
            )
        return self

    @property
    def pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    async def __aexit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        for worker in self._workers:
            if worker.stdin is not None and not worker.stdin.is_closing():
                worker.stdin.close()  # the end of its jobs: a worker between levels exits
        for worker in self._workers:
            try:
                # An interrupted or failed run does not want the requests still in flight.
                await asyncio.wait_for(worker.wait(), 0 if exc_type is not None else EXIT_WAIT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    worker.kill()
                await worker.wait()

    async def run_level(
        self,
        spec: LoadSpec,
        mode: Literal["concurrency", "rate"],
        level: float,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> list[RequestResult]:
        """The level split over the workers, started together; every request's result."""
        parts = split_level(spec, mode, level, len(self._workers))
        workers = self._workers[: len(parts)]
        for worker, part in zip(workers, parts, strict=True):
            await _send(worker, Job(spec=spec, mode=mode, level=level, part=part))
        for worker in workers:
            await _expect_ready(worker)
        go = Go(start_at=time.monotonic() + START_MARGIN_S)
        for worker in workers:
            await _send(worker, go)
        return merge_results(await asyncio.gather(*(_collect(worker, on_result) for worker in workers)))


async def _send(worker: asyncio.subprocess.Process, message: BaseModel) -> None:
    assert worker.stdin is not None  # opened with a pipe
    worker.stdin.write(message.model_dump_json().encode() + b"\n")
    await worker.stdin.drain()


async def _read(worker: asyncio.subprocess.Process) -> Ready | Result | Done:
    assert worker.stdout is not None  # opened with a pipe
    line = await worker.stdout.readline()
    if not line:
        code = await worker.wait()
        raise WorkerDied(f"a client worker process ended during the level (exit {code}); its error is above")
    return WorkerLine.validate_json(line)


async def _expect_ready(worker: asyncio.subprocess.Process) -> None:
    message = await _read(worker)
    if not isinstance(message, Ready):
        raise WorkerDied(f"a client worker answered {message.kind!r} to its job, not 'ready'")


async def _collect(
    worker: asyncio.subprocess.Process, on_result: Callable[[RequestResult], None] | None
) -> list[RequestResult]:
    results = []
    while not isinstance(message := await _read(worker), Done):
        if isinstance(message, Result):
            results.append(message.result)
            if on_result is not None:
                on_result(message.result)
    return results


async def _work(job: Job, stdin: IO[str], say: Callable[[BaseModel], None]) -> None:
    async with make_client(job.spec) as client:
        say(Ready())
        go = Go.model_validate_json(stdin.readline())  # nothing else runs yet: a blocking read is fine
        await run_level(
            job.spec,
            job.mode,
            job.level,
            part=job.part,
            client=client,
            start_at=go.start_at,
            on_result=lambda result: say(Result(result=result)),
        )
    say(Done())


def main() -> None:
    """The worker: jobs from stdin until it closes."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the channel

    def say(message: BaseModel) -> None:
        channel.write(message.model_dump_json() + "\n")
        channel.flush()

    while line := sys.stdin.readline():
        asyncio.run(_work(Job.model_validate_json(line), sys.stdin, say))


if __name__ == "__main__":
    main()
