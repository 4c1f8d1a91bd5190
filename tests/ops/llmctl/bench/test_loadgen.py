"""The multiturn workload, through real HTTP with the official client: each turn resends the
whole conversation (the server's own answers included) after a shared system prompt, and the
server's cached-token counts become the level's prefix cache hit rate."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from ops.harness.processes import free_port
from ops.harness.stub_upstream import chunk, sse
from ops.llmctl.bench.loadgen import LoadSpec, run_level
from ops.llmctl.bench.stats import LengthDistribution, summarise

HANG_BOUND_S = 20  # only bounds a hang


class Conversations:
    """Streams `answer-<n>` and reports half of each prompt as cached; records every request."""

    def __init__(self) -> None:
        self.requests: list[list[dict]] = []

    async def chat(self, request: Request) -> StreamingResponse:
        body = await request.json()
        self.requests.append(body["messages"])
        n = len(self.requests)
        prompt = 10 * len(body["messages"])
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 1,
            "total_tokens": prompt + 1,
            "prompt_tokens_details": {"cached_tokens": prompt // 2},
        }

        async def stream():
            yield sse(chunk(body["model"], {"role": "assistant", "content": f"answer-{n}"}))
            yield sse(chunk(body["model"], {}, finish="stop"))
            yield sse(chunk(body["model"], usage=usage))
            yield sse("[DONE]")

        return StreamingResponse(stream(), media_type="text/event-stream")


@contextmanager
def serving(app) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + HANG_BOUND_S
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(HANG_BOUND_S)


def test_multiturn_conversations_resend_their_history():
    fake = Conversations()
    with serving(Starlette(routes=[Route("/v1/chat/completions", fake.chat, methods=["POST"])])) as url:
        spec = LoadSpec(
            base_url=url,
            model="m",
            prompt_tokens=LengthDistribution.parse("fixed:3"),
            output_tokens=LengthDistribution.parse("fixed:1"),
            requests=6,
            workload="multiturn",
            turns=3,
            system_prompt_tokens=5,
            timeout_s=HANG_BOUND_S,
        )
        results = asyncio.run(run_level(spec, "concurrency", 1))
    assert len(results) == len(fake.requests) == 6  # two conversations of three turns, one at a time
    first, second, third = fake.requests[:3]
    system = first[0]
    assert system["role"] == "system" and len(system["content"].split()) == 5
    assert [m["role"] for m in third] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert third[:5] == [*second, {"role": "assistant", "content": "answer-2"}]
    assert second[2] == {"role": "assistant", "content": "answer-1"}  # the server's own answer, resent
    assert fake.requests[3][0] == system and len(fake.requests[3]) == 2  # a new conversation, same system prompt
    summary = summarise(results, "concurrency", 1)
    assert summary.prefix_cache_hit_rate == 0.5 and summary.cached_prompt_tokens == summary.prompt_tokens // 2
    json.dumps(summary.model_dump())  # the report stays JSON


def test_servers_without_cached_token_counts_have_no_hit_rate():
    from ops.llmctl.bench.stats import RequestResult

    results = [RequestResult(start=0, end=1, first_token=0.5, chunk_times=[0.5], prompt_tokens=10, output_tokens=1)]
    assert summarise(results, "concurrency", 1).prefix_cache_hit_rate is None
