"""A fake upstream that serves any number of requests at once and counts them (`running`, `peak`,
`served`): the fair-queue tests check, by the upstream's own count, that the gateway held the
line at the model's capacity. `arrivals` lists each request's `user` field as it came in (the
order the gateway let them through), `priorities` its (`user`, `priority`) pair. A request
steers it by its message text:

- `hold`: answer once the test sets `gate`, or give up when the caller goes away (a gateway
  killed mid-request, a client that left);
- `fail`: a 500;
- `sleep`: answer after `sleep_s`;
- `slow`: answer after 1.5 s, longer than the idle timeout the cold-start test gives a warm model;
- anything else: answer at once.
"""

from __future__ import annotations

import asyncio
import threading

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


class CountingUpstream:
    def __init__(self, sleep_s: float = 0.1) -> None:
        self.sleep_s = sleep_s
        self.url = ""  # set by whoever serves app()
        self.gate = threading.Event()
        self.lock = threading.Lock()
        self.running = self.peak = self.served = 0
        self.arrivals: list[str | None] = []
        self.priorities: list[tuple[str | None, int | None]] = []

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    def reset(self) -> None:
        """A closed gate and zero counts, for the next test on the same server."""
        self.gate.clear()
        with self.lock:
            self.running = self.peak = self.served = 0
            self.arrivals = []
            self.priorities = []

    def _count(self, step: int) -> None:
        with self.lock:
            self.running += step
            self.peak = max(self.peak, self.running)
            self.served += step < 0

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        what = body["messages"][0]["content"]
        with self.lock:
            self.arrivals.append(body.get("user"))
            self.priorities.append((body.get("user"), body.get("priority")))
        self._count(+1)
        try:
            if what == "fail":
                return JSONResponse({"error": {"message": "boom", "type": "InternalServerError"}}, status_code=500)
            while what == "hold" and not self.gate.is_set():
                if await request.is_disconnected():
                    return Response(status_code=499)
                await asyncio.sleep(0.01)
            if what in ("sleep", "slow"):
                await asyncio.sleep(self.sleep_s if what == "sleep" else 1.5)
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "usage": USAGE,
                    "choices": [
                        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}
                    ],
                }
            )
        finally:
            self._count(-1)
