"""An OpenAI-shaped stand-in for Ray Serve, for gateway benchmarks and fault tests only.

It answers instantly (no model), so a benchmark through it measures the gateway, not
inference; and it runs as its own process, so a test can kill it mid-stream. It is never a
substitute for the real serving path, which tests/test_dev_stack_e2e.py drives.

    python -m ops.harness.stub_upstream --port 9000

Requests may steer it with headers:
    x-stub-chunks: N        stream N content chunks (default 8)
    x-stub-interval-ms: T   sleep T ms between chunks (default 0); a non-streamed answer waits N x T ms
Streams end with a usage chunk when the request asks for `stream_options.include_usage`, and
carry the usage so far in every chunk when it also asks for `continuous_usage_stats`, as vLLM does.
or, where headers do not reach it, with a line in the first message's content:
    #stub {"chunks": N, "interval_ms": T, "prompt_tokens": "P"}
(`prompt_tokens` as a string, so a test can give it a fixed width; default 5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

# The request the gateway benchmarks send through to this stub.
CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "What is a KV cache?"}], "max_tokens": 16}
PROMPT_TOKENS = 5


def chunk(model: str, delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    """One `chat.completion.chunk`: a delta (or none, for the usage-only chunk) and/or usage."""
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def sse(payload: dict | str) -> bytes:
    """One server-sent event as OpenAI streams them: `data: <json or [DONE]>` and a blank line."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "stub"}]})


def steering(body: dict) -> dict:
    messages = body.get("messages")
    content = (
        messages[0].get("content")
        if isinstance(messages, list) and messages and isinstance(messages[0], dict)
        else None
    )
    if isinstance(content, str) and "#stub " in content:
        return json.JSONDecoder().raw_decode(content.split("#stub ", 1)[1])[0]
    return {}


async def chat(request: Request) -> Response:
    body = await request.json()
    model = body.get("model", "tiny")
    steer = steering(body)
    chunks = int(steer.get("chunks", request.headers.get("x-stub-chunks", "8")))
    interval = int(steer.get("interval_ms", request.headers.get("x-stub-interval-ms", "0"))) / 1000
    prompt_tokens = int(steer.get("prompt_tokens", PROMPT_TOKENS))
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": chunks, "total_tokens": prompt_tokens + chunks}
    if not body.get("stream"):
        if interval:
            await asyncio.sleep(interval * chunks)  # as long as the stream would have taken
        return JSONResponse(
            {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": " tok" * chunks}}
                ],
                "usage": usage,
            }
        )
    options = body.get("stream_options") or {}
    include_usage = options.get("include_usage") is True
    # As vLLM does: with include_usage and continuous_usage_stats, every chunk carries the usage so far.
    continuous = include_usage and options.get("continuous_usage_stats") is True

    def so_far(completion: int) -> dict | None:
        return (
            {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            }
            if continuous
            else None
        )

    async def events():
        yield sse(chunk(model, {"role": "assistant", "content": ""}, usage=so_far(0)))
        for done in range(1, chunks + 1):
            if interval:
                await asyncio.sleep(interval)
            yield sse(chunk(model, {"content": " tok"}, usage=so_far(done)))
        yield sse(chunk(model, {}, finish="stop", usage=so_far(chunks)))
        if include_usage:
            yield sse(chunk(model, usage=usage))
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def app() -> Starlette:
    return Starlette(
        routes=[Route("/v1/models", models, methods=["GET"]), Route("/v1/chat/completions", chat, methods=["POST"])]
    )


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(app(), host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
