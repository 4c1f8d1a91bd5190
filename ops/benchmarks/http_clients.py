"""Why the gateway's proxy uses aiohttp: CPU per proxied request of the two async HTTP
clients it could use, against the same stub upstream, with 50 requests in flight.

    python -m ops.benchmarks.http_clients [--requests 2000] [--in-flight 50]

CPU time (this process's, per request) rather than wall time, because these machines are
shared: CPU per request does not change much when other work runs, wall time does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import httpx

from ops.harness.processes import background, free_port, wait_for_http
from ops.harness.stub_upstream import CHAT_BODY as BODY

Request = Callable[[], Awaitable[None]]


async def measure(one: Request, count: int, in_flight: int) -> float:
    """CPU milliseconds per request, `count` requests with at most `in_flight` at once."""
    gate = asyncio.Semaphore(in_flight)

    async def guarded() -> None:
        async with gate:
            await one()

    started = time.process_time()
    await asyncio.gather(*[guarded() for _ in range(count)])
    return (time.process_time() - started) / count * 1000


async def with_httpx(url: str, count: int, in_flight: int) -> float:
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100)) as client:

        async def one() -> None:
            request = client.build_request("POST", url, json=BODY)
            response = await client.send(request, stream=True)
            async for _ in response.aiter_raw():
                pass
            await response.aclose()

        return await measure(one, count, in_flight)


async def with_aiohttp(url: str, count: int, in_flight: int) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000)) as session:

        async def one() -> None:
            async with session.post(url, json=BODY) as response:
                async for _ in response.content.iter_any():
                    pass

        return await measure(one, count, in_flight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=50)
    args = parser.parse_args()
    port = free_port()
    with background(
        [sys.executable, "-m", "ops.harness.stub_upstream", "--port", str(port)], Path("/dev/null")
    ) as stub:
        wait_for_http(f"http://127.0.0.1:{port}/v1/models", stub)
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        results: dict[str, list[float]] = {"httpx": [], "aiohttp": []}
        for _ in range(2):  # interleaved, so both see the same machine
            results["httpx"].append(asyncio.run(with_httpx(url, args.requests, args.in_flight)))
            results["aiohttp"].append(asyncio.run(with_aiohttp(url, args.requests, args.in_flight)))
    summary: dict[str, list[float] | float] = {name: [round(v, 3) for v in values] for name, values in results.items()}
    summary["httpx_over_aiohttp"] = round(min(results["httpx"]) / min(results["aiohttp"]), 1)
    print(json.dumps({"cpu_ms_per_request": summary, "in_flight": args.in_flight}, indent=2))


if __name__ == "__main__":
    main()
