"""A fake streaming engine that gets slower the more it runs at once, as a batching engine does:
each request's first token comes `ms_per_stream` x (streams in flight, itself included) after it
arrived, then `tokens` chunks `itl_ms` apart, a final usage chunk and `data: [DONE]`. It counts
what it runs (`running`, `peak`, `served`), so a test can check by the engine's own count how
many requests the gateway let through at once.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route


class LoadedUpstream:
    def __init__(self, ms_per_stream: float = 40.0, itl_ms: float = 5.0, tokens: int = 4) -> None:
        self.ms_per_stream, self.itl_ms, self.tokens = ms_per_stream, itl_ms, tokens
        self.lock = threading.Lock()
        self.running = self.peak = self.served = 0

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    def reset_peak(self) -> None:
        with self.lock:
            self.peak = self.running

    def _count(self, step: int) -> int:
        with self.lock:
            self.running += step
            self.peak = max(self.peak, self.running)
            self.served += step < 0
            return self.running

    async def chat(self, request: Request) -> StreamingResponse:
        body = await request.json()
        model = body["model"]

        def event(delta: dict, finish: str | None = None, usage: dict | None = None) -> bytes:
            choices = [] if usage is not None and not delta else [{"index": 0, "delta": delta, "finish_reason": finish}]
            chunk = {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": model,
                "choices": choices,
                **({"usage": usage} if usage is not None else {}),
            }
            return f"data: {json.dumps(chunk)}\n\n".encode()

        async def events() -> AsyncIterator[bytes]:
            in_flight = self._count(+1)
            try:
                await asyncio.sleep(self.ms_per_stream * in_flight / 1000)  # prefill among the others
                for i in range(self.tokens):
                    if i:
                        await asyncio.sleep(self.itl_ms / 1000)
                    usage = {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": 6 + i}
                    yield event({"content": "tok "}, "stop" if i == self.tokens - 1 else None, usage)
                yield event(
                    {}, usage={"prompt_tokens": 5, "completion_tokens": self.tokens, "total_tokens": 5 + self.tokens}
                )
                yield b"data: [DONE]\n\n"
            finally:
                self._count(-1)

        return StreamingResponse(events(), media_type="text/event-stream")
