"""The client side of `ops.benchmarks.fair_capacity`: closed-loop streamed requests against the
gateway with every outcome recorded (`Load`), and the worker process that sends one share of a
phase's streams (`python -m ops.benchmarks.fair_load`).

Why several processes: one aiohttp process reading the Jain phase's 384 streams of 128 tokens
is CPU-bound on a 2-core machine (client latency mean 6.8-8.9 s where the gateway's was 2.0-4.7 s,
the log's quiet run), so each tenant's output tokens/s were the client's turnaround, not the
queue's split. `llmctl bench`'s worker pool (`ops.llmctl.bench.workers`) runs the shares: each
worker gets a `Share` (its part of every tenant's streams), says it is ready once its client is
built, starts at the one instant the pool gives them all, and reports its request records when
the phase ends. Every time in a record is on the parent's clock origin (`Share.started`, the
machine's monotonic clock, which all processes share), so the parent summarizes them as its own.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from ops.llmctl.bench.split import even_split
from ops.llmctl.bench.workers import serve

OUTPUT_TOKENS = 32
CHAT_WORDS = 30
# One connection per request (no keep-alive). A pooled connection can be reused just as the server
# in front (make dev's edge, HAProxy: `timeout http-keep-alive` = gateway.edge.header_timeout_s)
# closes it: the server starts its idle timer when it has sent a response's end, a busy client
# reads that end late, and a request sent on the closing connection fails before any byte
# (aiohttp's ServerDisconnectedError), which no retry may paper over (a POST sent twice may be
# generated and billed twice). Keeping idle connections for half the edge's timeout still lost
# 162 of ~1,600 requests in the steady part of a 384-stream Jain phase whose client lagged
# 1.4-2.3x behind the gateway; one connection per request lost none there (11 at the phase's
# start and stop, not examined), for a loopback connect per request.


class Share(BaseModel):
    """One client process's part of a phase: how many streams it keeps for each tenant."""

    base_url: str = Field(description="The gateway's OpenAI base URL (make dev's, ending in /v1).")
    keys: dict[str, str] = Field(description="Tenant -> its API key.")
    streams: dict[str, int] = Field(description="Tenant -> the streams this process keeps in flight.")
    model: str = Field(description="The model every request asks for.")
    phase: str = Field(description="The records' phase name.")
    output_tokens: int = Field(description="max_tokens of each request (ignore_eos: exactly that many).")
    started: float = Field(description="The parent's clock origin (monotonic): records' times count from it.")
    seconds: float = Field(description="How long the streams send, from the pool's start instant.")


def shares(streams: dict[str, int], clients: int) -> list[dict[str, int]]:
    """Each tenant's streams dealt over `clients` processes as evenly as they go (`even_split`),
    the remainders of successive tenants starting at successive processes so no process gets all
    of them; processes that would get no stream at all are left out."""
    parts: list[dict[str, int]] = [{} for _ in range(clients)]
    for offset, (tenant, total) in enumerate(streams.items()):
        for index, count in enumerate(even_split(total, clients)):
            parts[(index + offset) % clients][tenant] = count
    return [part for part in parts if any(part.values())]


def prompt_text(words: int, number: int | None = None) -> str:
    """`words` x "hello", after `number` when given: a prompt of its own, nothing of it in vLLM's
    prefix cache (a cache hit on its first block would make every later block one too)."""
    text = " ".join(["hello"] * words)
    return text if number is None else f"{number} {text}"


class Load:
    """Closed-loop streamed chat requests against the gateway; every outcome recorded."""

    def __init__(self, base_url: str, keys: dict[str, str]) -> None:
        import aiohttp

        # aiohttp, not httpx: one httpx AsyncClient relaying 16 streams completed 15 requests/s where
        # aiohttp completed 40 against the same make dev, and the difference waited in the client
        # (client TTFT p50 0.9 s vs the gateway's own 0.05 s), so every client-side latency here was
        # the client's queue, and a flood's requests never reached the gateway to be queued fairly.
        self.base_url, self.keys = base_url.rstrip("/"), keys
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),  # see the note at the top
            timeout=aiohttp.ClientTimeout(total=600),
        )
        self.records: list[dict[str, Any]] = []
        self.words = CHAT_WORDS
        self.output_tokens = OUTPUT_TOKENS
        self.sent = 0
        self.completions = False  # the growth phase: /v1/completions, its prompt `words` long

    async def one(self, tenant: str, model: str, phase: str, started: float) -> None:
        import aiohttp

        loop = asyncio.get_running_loop()
        sent = loop.time()
        record: dict[str, Any] = {"tenant": tenant, "model": model, "phase": phase, "sent": sent - started}
        if self.completions:
            self.sent += 1
        text = prompt_text(self.words, self.sent if self.completions else None)
        body: dict[str, Any] = {
            "model": model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": self.output_tokens,
            "ignore_eos": True,
        }
        if self.completions:
            path, body["prompt"] = "/completions", text
        else:
            path, body["messages"] = "/chat/completions", [{"role": "user", "content": text}]
        try:
            async with self.client.post(
                self.base_url + path, json=body, headers={"authorization": f"Bearer {self.keys[tenant]}"}
            ) as response:
                record["status"] = response.status
                record["request_id"] = response.headers.get("x-request-id")
                record["queue_wait_ms"] = int(response.headers.get("x-queue-wait-ms", "0") or 0)
                if response.status != 200:  # the error's code says which refusal (queue full, a limit)
                    error = (await response.json(content_type=None) or {}).get("error") or {}
                    record["error"] = str(error.get("code") or error.get("type") or "")
                async for raw in response.content:
                    line = raw.decode().rstrip("\r\n")
                    if line.startswith("event: error"):
                        record["error"] = "error event"
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        record["error"] = "error event"
                    choices = event.get("choices") or []
                    if any((c.get("delta") or {}).get("content") or c.get("text") for c in choices):
                        record.setdefault("ttft", loop.time() - sent)
                    if event.get("usage"):
                        record["output_tokens"] = event["usage"].get("completion_tokens", 0)
                        record["prompt_tokens"] = event["usage"].get("prompt_tokens", 0)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # a broken stream, a timeout, a garbled event
            record.setdefault("status", 0)
            record["error"] = type(exc).__name__
        record["done"] = loop.time() - started
        self.records.append(record)

    async def closed(self, tenant: str, model: str, phase: str, streams: int, until: float, started: float) -> None:
        loop = asyncio.get_running_loop()

        async def caller() -> None:
            while loop.time() < until:
                await self.one(tenant, model, phase, started)

        await asyncio.gather(*(caller() for _ in range(streams)))


async def run_share(share: Share, ready: Callable[[], float], report: Callable[[dict[str, Any]], None]) -> None:
    """A worker's job: its streams of every tenant from the pool's start instant for `seconds`,
    then its records. Reported at the end, not as each request ends: during the phase the
    process's CPU goes to its streams."""
    load = Load(share.base_url, share.keys)
    load.output_tokens = share.output_tokens
    try:
        start_at = ready()
        await asyncio.sleep(max(0.0, start_at - asyncio.get_running_loop().time()))
        until = start_at + share.seconds
        await asyncio.gather(
            *(load.closed(t, share.model, share.phase, n, until, share.started) for t, n in share.streams.items() if n)
        )
    finally:
        await load.client.close()
    for record in load.records:
        report(record)


if __name__ == "__main__":
    serve(Share, run_share)
