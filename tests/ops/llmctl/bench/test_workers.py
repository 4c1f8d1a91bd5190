"""`llmctl bench`'s client processes through real HTTP: a level split over a pool of workers
reaches the server from each of them, every request once, and comes back as one level."""

from __future__ import annotations

import asyncio
from collections import Counter

import psutil
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from ops.llmctl.bench.loadgen import LoadSpec, schedule
from ops.llmctl.bench.stats import LengthDistribution, summarise
from ops.llmctl.bench.workers import WorkerPool
from tests.support.openai_fakes import ok_stream
from tests.support.servers import HANG_BOUND_S, serving


class Recorder:
    """Streams one content chunk and the usage; records each prompt and the process that sent it."""

    def __init__(self) -> None:
        self.prompts: list[str] = []
        self.senders: Counter[int] = Counter()

    def sender(self, request: Request) -> int:
        assert request.client is not None
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == request.client.port and conn.raddr and conn.pid:
                if conn.raddr.port == request.url.port:
                    return conn.pid
        return 0

    async def chat(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.prompts.append(body["messages"][-1]["content"])
        self.senders[self.sender(request)] += 1
        return ok_stream(body["model"], completion_tokens=1)


def load(url: str, **update) -> LoadSpec:
    return LoadSpec(
        base_url=f"{url}/v1",
        model="m",
        prompt_tokens=LengthDistribution.parse("uniform:4-12"),
        output_tokens=LengthDistribution.parse("fixed:1"),
        timeout_s=HANG_BOUND_S,
        **update,
    )


async def run(pool_size: int, spec: LoadSpec, mode, level: float) -> tuple[list, set[int]]:
    seen = []
    async with WorkerPool(pool_size) as pool:
        workers = set(pool.pids)
        results = await pool.run_level(spec, mode, level, on_result=seen.append)
    assert sorted(r.start for r in seen) == [r.start for r in results]  # each reported as it ended
    return results, workers


def test_closed_loop_is_sent_by_every_worker_each_request_once():
    fake = Recorder()
    with serving(Starlette(routes=[Route("/v1/chat/completions", fake.chat, methods=["POST"])])) as url:
        spec = load(url, requests=12)
        results, workers = asyncio.run(run(2, spec, "concurrency", 4))
    assert len(workers) == 2
    assert set(fake.senders) == workers and sorted(fake.senders.values()) == [6, 6]  # not this process
    assert len(results) == len(fake.prompts) == 12
    assert len(set(fake.prompts)) == 12  # each worker draws its own prompts, none sent twice
    summary = summarise(results, "concurrency", 4)
    assert (summary.ok, summary.errors, summary.output_tokens) == (12, {}, 12)


def test_open_loop_sends_the_levels_one_schedule_from_every_worker():
    fake = Recorder()
    with serving(Starlette(routes=[Route("/v1/chat/completions", fake.chat, methods=["POST"])])) as url:
        spec = load(url, requests=9)
        results, workers = asyncio.run(run(3, spec, "rate", 30))
    assert set(fake.senders) == workers and list(fake.senders.values()) == [3, 3, 3]
    assert sorted(fake.prompts) == sorted(a.prompt for a in schedule(spec, 30))
    assert summarise(results, "rate", 30).ok == 9
