"""Helpers for the gateway's tests (fixtures built on them: tests/serving/gateway/conftest.py).

A recording upstream that keeps every request line as it arrived (method, raw path bytes,
query string, headers, body); a real gateway served as `python -m serving.gateway` serves it
(both ports, one event loop, uvicorn); raw requests that reach the server byte for byte.

The recording upstream answers any path with 200 JSON (a completion, or a model list), unless
a test scripts another answer, so a request that should never have been sent shows up both in
the record and in the response the caller gets.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ops.harness.processes import free_port
from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.http.app import create_apps
from serving.gateway.http.server import GatewayServer
from tests.support.servers import HANG_BOUND_S, fail_if_running

MODELS = ["tiny", "other"]
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
GENEROUS = {
    "requests_per_minute": 1_000_000,
    "tokens_per_minute": 10**9,
    "daily_token_budget": 10**12,
    "max_concurrent_requests": 100,
}


def generous_key(
    redis_url: str, tenant: str, name: str, *, tier: str | None = None, weight: float | None = None
) -> str:
    """A key with GENEROUS limits (only the queue decides), in `tier` with `weight`."""
    return create_key_sync(redis_url, tenant, name, limits=GENEROUS, tier=tier, weight=weight)


@dataclass(frozen=True)
class Seen:
    """One request as the upstream received it."""

    method: str
    raw_path: bytes
    query: bytes
    headers: dict[str, str]
    body: bytes

    @property
    def request_line(self) -> str:
        target = self.raw_path + (b"?" + self.query if self.query else b"")
        return f"{self.method} {target.decode('latin-1')}"


@dataclass(frozen=True)
class Answer:
    """What the recording upstream answers: status, headers (name, value) and body."""

    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""


def default_answer(seen: Seen) -> Answer:
    if seen.raw_path.startswith(b"/v1/models"):
        body = {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "llmstack"} for m in MODELS]}
    else:
        body = {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "tiny",
            "usage": USAGE,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
        }
    return Answer(200, (("content-type", "application/json"),), json.dumps(body).encode())


@dataclass
class RecordingUpstream:
    url: str = ""
    seen: list[Seen] = field(default_factory=list)
    answer: Callable[[Seen], Answer] = default_answer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen = Seen(
            scope["method"],
            scope["raw_path"],
            scope["query_string"],
            {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]},
            body,
        )
        self.seen.append(seen)
        answer = self.answer(seen)
        await send(
            {
                "type": "http.response.start",
                "status": answer.status,
                "headers": [(k.encode(), v.encode()) for k, v in answer.headers],
            }
        )
        await send({"type": "http.response.body", "body": answer.body})


@contextmanager
def serving_gateway(settings: GatewaySettings) -> Iterator[tuple[str, str]]:
    """A gateway as `python -m serving.gateway` runs one (serving.gateway.http.server), on free
    ports in a thread: yields (API URL, metrics-port URL)."""
    settings = settings.model_copy(
        update={"host": "127.0.0.1", "port": free_port(), "metrics_port": free_port(), "shutdown_grace_s": 5}
    )
    store = RedisKeyStore(settings.redis_url)
    server = GatewayServer(create_apps(settings, store), settings)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started, thread, "the gateway")
        yield f"http://127.0.0.1:{settings.port}", f"http://127.0.0.1:{settings.metrics_port}"
    finally:
        server.stop()
        thread.join(HANG_BOUND_S)
    fail_if_running(thread, "the gateway")


def _wait(ready: Callable[[], bool], thread: threading.Thread, what: str) -> None:
    deadline = time.monotonic() + HANG_BOUND_S
    while not ready():
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.02)


def raw_request(
    base_url: str, method: str, target: str, *, headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request with `target` sent byte for byte (http.client neither normalizes nor
    re-encodes it, unlike httpx): (status, lower-cased headers, body)."""
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HANG_BOUND_S)
    try:
        connection.request(method, target, body=body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def gateway_settings(upstream_url: str, redis_url: str, **overrides) -> GatewaySettings:
    values = {
        "models": MODELS,
        "max_body_bytes": 64_000,
        "upstream_idle_timeout_s": 30,
        "model_context_lengths": {"tiny": 4096, "other": 4096},
        **overrides,
    }
    return GatewaySettings(upstream_url=upstream_url, redis_url=redis_url, **values)
