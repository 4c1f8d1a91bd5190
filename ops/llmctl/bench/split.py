"""Cutting a load level into parts for several client processes, and putting their results back
together. Pure: `ops.llmctl.bench.workers` runs the parts.

Why parts: one Python process streaming many requests through one `AsyncOpenAI` client spends
CPU on every streamed chunk (SSE parsing, the SDK's pydantic chunk objects, httpx2), and past a
dozen or so streams the requests queue in the client: a benchmark that measures its own client.
Several processes, each with its own client and a share of the level, keep up with the server.

  closed loop  the concurrency is dealt out as evenly as it goes (16 over 3 processes: 6, 5, 5),
               and a request count in the same proportion; each part draws its own prompts
  open loop    the level's one Poisson schedule (`loadgen.schedule`) is drawn once and dealt
               round-robin, so together the parts send exactly the arrivals one process would,
               at the same instants; each part alone is every k-th of them
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from ops.llmctl.bench.loadgen import LevelPart, LoadSpec, schedule
from ops.llmctl.bench.stats import RequestResult

# Streams one client process carries before it is given another. Profiled (py-spy) at 16 streams
# of 32 tokens on make dev, one process never waited in its selector: about half its time in the
# SDK (a pydantic object per chunk), a third in httpx2/httpcore2/h11, the rest asyncio.
STREAMS_PER_PROCESS = 8
# Open loop: requests/s one client process is given before another is added.
RATE_PER_PROCESS = 8.0


def even_split(total: int, parts: int) -> list[int]:
    """`total` in `parts` shares differing by at most one, the larger ones first."""
    if parts < 1 or total < 0:
        raise ValueError(f"cannot split {total} into {parts} parts")
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def split_level(spec: LoadSpec, mode: Literal["concurrency", "rate"], level: float, processes: int) -> list[LevelPart]:
    """The level as at most `processes` parts, none of them empty. The open loop's schedule must
    end: a request count or a duration in the spec."""
    if mode == "concurrency":
        loops = [n for n in even_split(int(level), min(processes, int(level))) if n]
        counts: list[int | None] = (
            list(even_split(spec.requests, len(loops))) if spec.requests is not None else [None] * len(loops)
        )
        return [
            LevelPart(index=i, concurrency=n, requests=count)
            for i, (n, count) in enumerate(zip(loops, counts, strict=True))
            if count != 0
        ]
    if spec.requests is None and spec.duration_s is None:
        raise ValueError("an open loop split over processes needs a request count or a duration")
    arrivals = list(schedule(spec, level))
    parts = min(processes, len(arrivals))
    return [LevelPart(index=i, arrivals=arrivals[i::parts]) for i in range(parts)]


def merge_results(parts: Iterable[list[RequestResult]]) -> list[RequestResult]:
    """The parts' results as one level's, in the order they were sent. Their times are all on
    the machine's one monotonic clock, so the level's wall time (first send to last finish)
    and throughput come out of `stats.summarise` as for one process."""
    return sorted((result for part in parts for result in part), key=lambda result: result.start)


def default_processes(mode: Literal["concurrency", "rate"], levels: Iterable[float], cpus: int) -> int:
    """Client processes for a run: enough for its highest level (a process per
    `STREAMS_PER_PROCESS` streams, or per `RATE_PER_PROCESS` requests/s), at most one per core,
    at least one."""
    top = max(levels)
    wanted = math.ceil(top / (STREAMS_PER_PROCESS if mode == "concurrency" else RATE_PER_PROCESS))
    return max(1, min(wanted, cpus))
