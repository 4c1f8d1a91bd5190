"""The streaming relay (serving.gateway.upstream.proxy): how the upstream's reads reach the client.

Through HTTP: the real gateway under uvicorn, a real redis-server, and an upstream that writes
a scripted stream in exact pieces (each piece one write, a pause or a gate between them, so
the gateway reads them apart). The client reads the gateway's chunked body on a raw socket,
so each HTTP chunk it sees is one message the gateway sent.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ops.harness.stub_upstream import sse
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.tenants import key_daily_key
from tests.support.gateway import GENEROUS
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.vllm_upstream import daily_used, key_id_of, running_gateway
from tests.support.waiting import eventually

PAUSE_S = 0.005  # between two writes of the upstream: long enough for the gateway to read them apart


def event(index: int, text: str, completion: int, finish: str | None = None) -> bytes:
    return sse(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "model": "tiny",
            "choices": [{"index": index, "delta": {"content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion},
        }
    )


def without_usage(data: bytes) -> list[dict]:
    """The JSON events of an SSE body, usage removed (what a client that asked for none gets)."""
    events = [json.loads(e[len(b"data: ") :]) for e in data.split(b"\n\n") if e.startswith(b"data: {")]
    return [{k: v for k, v in e.items() if k != "usage"} for e in events]


class ScriptedUpstream:
    """Answers every chat completion with `script`: bytes are written as they are (one write
    each, PAUSE_S apart), a threading.Event is waited for before going on."""

    def __init__(self) -> None:
        self.script: list[bytes | threading.Event] = []

    def app(self) -> Starlette:
        return Starlette(
            routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]), Route("/v1/models", self.models)]
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def chat(self, request: Request) -> Response:
        await request.body()
        script = list(self.script)

        async def pieces():
            for step in script:
                if isinstance(step, threading.Event):
                    while not step.is_set():
                        await asyncio.sleep(0.002)
                    continue
                yield step
                await asyncio.sleep(PAUSE_S)

        return StreamingResponse(pieces(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def scripted() -> Iterator[ScriptedUpstream]:
    fake = ScriptedUpstream()
    with serving(fake.app()) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake


@pytest.fixture(scope="module")
def scripted_gateway(redis_server, scripted) -> Iterator[str]:
    with running_gateway(scripted.url, redis_server.url) as url:
        yield url


@pytest.fixture
def key(redis_server) -> str:
    return create_key_sync(redis_server.url, "acme", "relay", limits=GENEROUS)


class ChunkedReader:
    """A streamed chat completion on a raw socket: `messages()` yields each HTTP chunk's bytes."""

    def __init__(self, scripted_gateway: str, key: str) -> None:
        url = urlsplit(scripted_gateway)
        body = json.dumps(
            {"model": "tiny", "stream": True, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}]}
        ).encode()
        self._sock = socket.create_connection((url.hostname, url.port), timeout=HANG_BOUND_S)
        self._sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nAuthorization: Bearer "
            + key.encode()
            + b"\r\nContent-Length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        self._file = self._sock.makefile("rb")
        status = self._file.readline()
        assert b" 200 " in status, status + self._file.read()
        headers = []
        while (line := self._file.readline()) not in (b"\r\n", b""):
            headers.append(line.lower())
        assert b"transfer-encoding: chunked\r\n" in headers

    def messages(self) -> Iterator[bytes]:
        while size := int(self._file.readline(), 16):
            data = self._file.read(size)
            assert self._file.read(2) == b"\r\n"
            yield data
        assert self._file.readline() == b"\r\n"  # the end of the body: a whole answer

    def close(self) -> None:
        self._file.close()
        self._sock.close()


def stream(scripted_gateway: str, key: str) -> list[bytes]:
    reader = ChunkedReader(scripted_gateway, key)
    try:
        return list(reader.messages())
    finally:
        reader.close()


def test_events_read_together_go_to_the_client_in_one_message_billed_the_last_usage(
    scripted_gateway, scripted, key, redis_server
):
    together = event(0, "a", 1) + event(0, "b", 2) + event(0, "c", 3, finish="stop")
    scripted.script = [together, sse("[DONE]")]
    messages = stream(scripted_gateway, key)
    assert without_usage(messages[0]) == without_usage(together)  # all three, usage stripped, in one message
    assert b"usage" not in b"".join(messages) and messages[-1].endswith(b"data: [DONE]\n\n")
    used = key_daily_key("acme", key_id_of(key))
    eventually(lambda: daily_used(redis_server.url, used) == 5 + 3, "not billed the last of the three usages")


def test_an_event_split_across_reads_at_every_byte_is_relayed_and_billed_whole(
    scripted_gateway, scripted, key, redis_server
):
    # The first event is parsed in full; the second, like it but for its text and usage, is read
    # by the bytes it repeats (serving.gateway.protocol.event_shape), here from every possible two pieces.
    first, whole, last = event(0, 'say "hi"', 1), event(0, 'a \\"quote\\"', 2), event(0, "", 2, finish="stop")
    scripted.script = [first, whole, last + sse("[DONE]")]
    expected = b"".join(stream(scripted_gateway, key))
    assert without_usage(expected) == without_usage(first + whole + last) and expected.endswith(b"data: [DONE]\n\n")
    assert b'{"content": "a \\\\\\"quote' in expected  # the upstream's own bytes: read by its shape, not parsed
    for cut in range(1, len(whole)):
        scripted.script = [first, whole[:cut], whole[cut:] + last + b"data: [DO", b"NE]\n\n"]
        assert b"".join(stream(scripted_gateway, key)) == expected, f"split at byte {cut}"
    used = key_daily_key("acme", key_id_of(key))
    eventually(lambda: daily_used(redis_server.url, used) == 7 * len(whole), "a split event was billed otherwise")


def test_a_whole_event_is_relayed_at_once_and_a_partial_one_waits_for_its_end(scripted_gateway, scripted, key):
    first, second = event(0, "a", 1), event(0, "b", 2, finish="stop")
    gate = threading.Event()
    # The first event and half of the second in one write; the rest only once the client has the first.
    scripted.script = [first + second[:40], gate, second[40:], sse("[DONE]")]
    reader = ChunkedReader(scripted_gateway, key)
    try:
        messages = reader.messages()
        got = next(messages)
        assert without_usage(got) == without_usage(first) and got.endswith(b"\n\n")  # nothing of the partial one
        gate.set()
        rest = b"".join(messages)
    finally:
        gate.set()
        reader.close()
    assert without_usage(rest) == without_usage(second + sse("[DONE]")) and rest.endswith(b"data: [DONE]\n\n")
