"""The fairness benchmark's client side: the Jain phase's streams dealt over client processes, each
record coming back on the parent's clock, and a pooled connection never reused once the server it
talks to may have closed it (through real HTTP)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from ops.benchmarks import fair_load
from ops.benchmarks.fair_load import Load, Share, prompt_text, shares
from ops.llmctl.bench.workers import WorkerPool
from tests.support.openai_fakes import ok_stream
from tests.support.servers import serving


class Tenants:
    """Streams one content chunk and the usage; counts the requests of each key."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()

    async def chat(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.requests[request.headers["authorization"].removeprefix("Bearer ")] += 1
        return ok_stream(body["model"], completion_tokens=2)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])


def test_each_tenant_s_streams_are_dealt_over_the_processes():
    parts = shares({"a": 5, "b": 5, "c": 2}, 2)
    assert parts == [{"a": 3, "b": 2, "c": 1}, {"a": 2, "b": 3, "c": 1}]  # the odd streams not all in one
    assert shares({"a": 96, "b": 96}, 1) == [{"a": 96, "b": 96}]
    assert shares({"a": 1}, 3) == [{"a": 1}]  # no process without a stream


def test_a_busy_client_does_not_reuse_a_connection_the_server_has_closed():
    """The client's loop is blocked (as a CPU-bound client's is) past the server's keep-alive: the
    server closes the idle connection, and the client has not yet seen it go. aiohttp's default
    (15 s) reuses it and the request fails before any byte; the benchmark's client does not."""
    tenants = Tenants()
    with serving(tenants.app(), keep_alive_s=1) as url:

        async def twice() -> list[dict]:
            load = Load(f"{url}/v1", {"t": "key-t"})
            try:
                loop = asyncio.get_running_loop()
                await load.one("t", "m", "p", loop.time())
                time.sleep(1.5)  # blocks the loop: the server's close is not read meanwhile
                await load.one("t", "m", "p", loop.time())
            finally:
                await load.client.close()
            return load.records

        records = asyncio.run(twice())
    assert [(r["status"], r.get("error"), r.get("output_tokens")) for r in records] == [(200, None, 2)] * 2
    assert tenants.requests == {"key-t": 2}


def test_the_processes_send_every_tenant_s_streams_and_return_their_records():
    tenants = Tenants()
    with serving(tenants.app()) as url:

        async def phase() -> tuple[float, float, list[list[dict]]]:
            started = asyncio.get_running_loop().time()
            jobs = [
                Share(
                    base_url=f"{url}/v1",
                    keys={"a": "key-a", "b": "key-b"},
                    streams=part,
                    model="m",
                    phase="jain",
                    output_tokens=2,
                    started=started,
                    seconds=1.0,
                )
                for part in shares({"a": 3, "b": 1}, 2)
            ]
            async with WorkerPool(len(jobs), module=fair_load.__name__) as pool:
                start = await pool.start(jobs)
                return started, start, await pool.results(dict)

        started, start, parts = asyncio.run(phase())
    assert len(parts) == 2 and all(parts)  # both processes sent
    records = [r for part in parts for r in part]
    assert Counter(r["tenant"] for r in records) == {"a": tenants.requests["key-a"], "b": tenants.requests["key-b"]}
    assert {(r["status"], r.get("error"), r["output_tokens"]) for r in records} == {(200, None, 2)}
    # on the parent's clock: sent from the pool's start instant, within the phase's second
    assert all(start - started <= r["sent"] < start - started + 1.0 for r in records)


def test_growth_prompts_start_apart_so_the_prefix_cache_cannot_serve_them():
    first, second = prompt_text(100, 1), prompt_text(100, 2)
    assert first.split()[0] != second.split()[0] and first.split()[1:] == second.split()[1:] == ["hello"] * 100
    assert prompt_text(3) == "hello hello hello"
