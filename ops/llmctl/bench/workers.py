"""Client processes for `llmctl bench`: each sends its part of a level (`ops.llmctl.bench.split`)
with its own `AsyncOpenAI` client, so the load is not held back by one process's CPU.

A worker is `python -m ops.llmctl.bench.workers` (the name `--cpu-layers` counts as the
client), alive for the whole run, speaking JSON lines:
  stdin   a `Job` per level, then, once every worker is `Ready`, a `Go` with the instant to
          start at (the machine's monotonic clock, which all processes share)
  stdout  `Ready` when its client is built, a `Result` per request as it ends, then `Done`
It ends when its stdin closes. Anything else the worker prints goes to stderr.

The pool and the protocol do not depend on what a job is: another load generator gives
`WorkerPool` its own worker module, which calls `serve` with its job type and its work, and
reads its results with `start` and `results` (`ops.benchmarks.fair_load` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, Field, TypeAdapter

from ops.llmctl.bench.loadgen import LevelPart, LoadSpec, make_client, run_level
from ops.llmctl.bench.split import merge_results, split_level
from ops.llmctl.bench.stats import RequestResult

# Between the last `Ready` and the start: long enough for every worker to read its `Go`.
START_MARGIN_S = 0.05
# A result line holds every chunk's arrival time; a job line every arrival of an open loop.
LINE_LIMIT = 64 * 1024 * 1024
EXIT_WAIT_S = 10


JobT = TypeVar("JobT", bound=BaseModel)
ResultT = TypeVar("ResultT")


class Job(BaseModel):
    """`llmctl bench`'s job: its part of one level."""

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
    # Whatever the worker's work reports (a `RequestResult` for `llmctl bench`); the pool reads
    # it back as the type its caller asks `results` for.
    result: Any


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

    def __init__(self, processes: int, module: str = "ops.llmctl.bench.workers") -> None:
        """`module`: the worker, run as `python -m module`; its main is `serve(...)`."""
        self.processes, self.module = processes, module
        self._workers: list[asyncio.subprocess.Process] = []
        self._started: list[asyncio.subprocess.Process] = []

    async def __aenter__(self) -> WorkerPool:
        for _ in range(self.processes):
            self._workers.append(
                await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    self.module,
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
        await self.start([Job(spec=spec, mode=mode, level=level, part=part) for part in parts])
        return merge_results(await self.results(RequestResult, on_result))

    async def start(self, jobs: Sequence[BaseModel]) -> float:
        """A job to each of the first `len(jobs)` workers and, once every one of them is ready,
        the one instant they all start at (`time.monotonic()`'s clock), which this returns."""
        if len(jobs) > len(self._workers):
            raise ValueError(f"{len(jobs)} jobs for {len(self._workers)} worker processes")
        self._started = self._workers[: len(jobs)]
        for worker, job in zip(self._started, jobs, strict=True):
            await _send(worker, job)
        for worker in self._started:
            await _expect_ready(worker)
        go = Go(start_at=time.monotonic() + START_MARGIN_S)
        for worker in self._started:
            await _send(worker, go)
        return go.start_at

    async def results(
        self, result_type: type[ResultT], on_result: Callable[[ResultT], None] | None = None
    ) -> list[list[ResultT]]:
        """The results of the workers `start` gave jobs, each worker's in the order it reported
        them, once every one of them is done."""
        adapter, workers, self._started = TypeAdapter(result_type), self._started, []
        return list(await asyncio.gather(*(_collect(worker, adapter, on_result) for worker in workers)))


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
    worker: asyncio.subprocess.Process,
    adapter: TypeAdapter[ResultT],
    on_result: Callable[[ResultT], None] | None,
) -> list[ResultT]:
    results = []
    while not isinstance(message := await _read(worker), Done):
        if isinstance(message, Result):
            result = adapter.validate_python(message.result)
            results.append(result)
            if on_result is not None:
                on_result(result)
    return results


def serve(
    job_type: type[JobT],
    work: Callable[[JobT, Callable[[], float], Callable[[Any], None]], Coroutine[Any, Any, None]],
) -> None:
    """A worker process's main: for each job from stdin (until it closes), `await work(job,
    ready, report)`, then `Done`. The work calls `ready()` once it is set up (a client built):
    that says `Ready` and returns the instant to start at, when every worker is; and
    `report(result)` for each result."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints must not corrupt the channel

    def say(message: BaseModel) -> None:
        channel.write(message.model_dump_json() + "\n")
        channel.flush()

    def ready() -> float:
        say(Ready())
        return Go.model_validate_json(sys.stdin.readline()).start_at  # nothing else runs yet: blocking is fine

    while line := sys.stdin.readline():
        asyncio.run(work(job_type.model_validate_json(line), ready, lambda result: say(Result(result=result))))
        say(Done())


async def _work(job: Job, ready: Callable[[], float], report: Callable[[RequestResult], None]) -> None:
    async with make_client(job.spec) as client:
        await run_level(job.spec, job.mode, job.level, part=job.part, client=client, start_at=ready(), on_result=report)


def main() -> None:
    """`llmctl bench`'s worker: jobs from stdin until it closes."""
    serve(Job, _work)


if __name__ == "__main__":
    main()
