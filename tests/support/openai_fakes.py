"""OpenAI-shaped fake upstreams for the gateway's HTTP tests, and the gateway in front of them:
`FakeUpstream` answers chat and models and records headers (steered by test headers the
settings let through), `StreamRecordingUpstream` records bodies and sends the usage chunk only
when asked, as OpenAI and vLLM do. Real uvicorn servers in threads, always stopped."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ops.harness.processes import free_port
from ops.harness.stub_upstream import chunk, sse
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.http.app import create_apps
from serving.gateway.http.server import GatewayServer
from tests.support.servers import HANG_BOUND_S, fail_if_running


def ok_stream(model: str, completion_tokens: int) -> StreamingResponse:
    """A streamed chat answer "ok": its content chunk, its finish, its usage, [DONE]."""
    usage = {"prompt_tokens": 3, "completion_tokens": completion_tokens, "total_tokens": 3 + completion_tokens}

    async def events():
        yield sse(chunk(model, {"role": "assistant", "content": "ok"}))
        yield sse(chunk(model, {}, finish="stop"))
        yield sse(chunk(model, usage=usage))
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


WORDS = ["Paged", " attention", " keeps", " the", " KV", " cache", " tidy", "."]


USAGE = {"prompt_tokens": 5, "completion_tokens": len(WORDS), "total_tokens": 5 + len(WORDS)}


class FakeUpstream:
    """Answers like an OpenAI server and records what the gateway sent it."""

    def __init__(self) -> None:
        self.seen_headers: list[dict[str, str]] = []
        self.client_has_first_chunk = threading.Event()
        self.gate_released_by_client: bool | None = None
        self.last_chunk_sent_at: float | None = None
        self.endless_ended = threading.Event()
        self.endless_finished = False

    def app(self) -> Starlette:
        return Starlette(
            routes=[Route("/v1/models", self.models), Route("/v1/chat/completions", self.chat, methods=["POST"])]
        )

    async def models(self, request: Request) -> JSONResponse:
        self.seen_headers.append(dict(request.headers))
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": m, "object": "model", "created": 0, "owned_by": "llmstack"} for m in ("tiny", "other")],
            }
        )

    async def chat(self, request: Request):
        self.seen_headers.append(dict(request.headers))
        body = await request.json()
        model = body["model"]
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "usage": USAGE,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "".join(WORDS)},
                        }
                    ],
                }
            )
        scenario = request.headers.get("x-test-scenario", "plain")
        stream = self._endless(model) if scenario == "endless" else self._words(model, gated=scenario == "gated")
        return StreamingResponse(stream, media_type="text/event-stream")

    async def _words(self, model: str, *, gated: bool):
        yield sse(chunk(model, {"role": "assistant", "content": ""}))
        yield sse(chunk(model, {"content": WORDS[0]}))
        if gated:  # hold the rest until the client proves it already has the first chunk
            self.gate_released_by_client = await asyncio.to_thread(self.client_has_first_chunk.wait, HANG_BOUND_S)
        for word in WORDS[1:]:
            await asyncio.sleep(0.01)
            yield sse(chunk(model, {"content": word}))
        self.last_chunk_sent_at = time.monotonic()
        yield sse(chunk(model, {}, finish="stop"))
        yield sse(chunk(model, usage=USAGE))
        yield sse("[DONE]")

    async def _endless(self, model: str):
        try:
            yield sse(chunk(model, {"role": "assistant", "content": ""}))
            for i in range(1000):
                yield sse(chunk(model, {"content": f" tok{i}"}))
                await asyncio.sleep(0.02)
            self.endless_finished = True
        finally:
            self.endless_ended.set()


# Headers the tests' upstreams are steered by: the gateway forwards only the headers its
# stack lists (plus content-type and accept), so the test stack lists these.
STEERING_HEADERS = ["x-test-scenario", "x-stub-chunks", "x-stub-interval-ms"]


def settings_for(upstream_url: str, redis_url: str | None, **overrides) -> GatewaySettings:
    values = {
        "models": ["tiny", "other"],
        "max_body_bytes": 4096,
        "upstream_idle_timeout_s": 30,
        "forward_request_headers": STEERING_HEADERS,
        **overrides,
    }
    return GatewaySettings(upstream_url=upstream_url, redis_url=redis_url, **values)


@contextmanager
def serving_gateway(settings: GatewaySettings, key_store) -> Iterator[tuple[str, str]]:
    """A gateway as `python -m serving.gateway` runs it (serving.gateway.http.server: both ports in
    one event loop), on free ports in a thread: yields (API URL, metrics-port URL)."""
    settings = settings.model_copy(
        update={"host": "127.0.0.1", "port": free_port(), "metrics_port": free_port(), "shutdown_grace_s": 5}
    )
    server = GatewayServer(create_apps(settings, key_store), settings)
    thread = threading.Thread(target=asyncio.run, args=(server.serve(),), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + HANG_BOUND_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{settings.port}", f"http://127.0.0.1:{settings.metrics_port}"
    finally:
        server.stop()
        thread.join(HANG_BOUND_S)
    fail_if_running(thread, "the gateway")


def chat(llm: openai.OpenAI, model: str = "tiny", **kwargs):
    """One chat completion with a fixed question through the official client."""
    return llm.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is a KV cache?"}], **kwargs
    )


def client(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)


PROMPT = "What is a KV cache?"


TEMPLATE_TOKENS = 256  # GatewayPolicy's default chat_template_tokens, written out by hand


RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-tokens",
)


class StreamRecordingUpstream:
    """An OpenAI-like upstream that records request bodies, sends the usage chunk only when
    asked (as OpenAI and vLLM do), and can stream slowly forever."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.slow_started = threading.Event()
        self.slow_ended = threading.Event()

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        model = body["model"]
        if not body.get("stream"):
            return JSONResponse(
                {
                    "id": "c",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "usage": USAGE,
                    "choices": [
                        {
                            "index": 0,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": "".join(WORDS)},
                        }
                    ],
                }
            )
        include_usage = (body.get("stream_options") or {}).get("include_usage") is True
        scenario = request.headers.get("x-test-scenario")
        if scenario == "silent":  # never answers: headers never come
            await asyncio.sleep(3600)
        stream = {"slow": self._slow, "stall": self._stall}.get(scenario)
        return StreamingResponse(
            stream(model) if stream else self._words(model, include_usage), media_type="text/event-stream"
        )

    async def _words(self, model: str, include_usage: bool):
        yield sse(chunk(model, {"role": "assistant", "content": ""}))
        for word in WORDS:
            yield sse(chunk(model, {"content": word}))
        yield sse(chunk(model, {}, finish="stop"))
        if include_usage:
            yield sse(chunk(model, usage=USAGE))
        yield sse("[DONE]")

    async def _stall(self, model: str):
        yield sse(chunk(model, {"role": "assistant", "content": "one"}))
        await asyncio.sleep(3600)  # then silence

    async def _slow(self, model: str):
        try:
            yield sse(chunk(model, {"role": "assistant", "content": ""}))
            self.slow_started.set()
            for i in range(1000):
                yield sse(chunk(model, {"content": f" tok{i}"}))
                await asyncio.sleep(0.05)
        finally:
            self.slow_ended.set()


def new_key(redis_server, **limits) -> str:
    return create_key_sync(redis_server.url, "acme", "limits", limits=limits)


def chat_payload(**body) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **body}).encode()


def chat_raw(gateway: str, key: str, **body) -> httpx.Response:
    return httpx.post(
        f"{gateway}/v1/chat/completions",
        content=chat_payload(**body),
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
