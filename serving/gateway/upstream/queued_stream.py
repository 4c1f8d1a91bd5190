"""A streaming request that waits for its slot after the response has begun.

A stream still queued after the queue's `keepalive_s` is answered 200 `text/event-stream` at
once, then gets an SSE comment (`: queued 12s`) every `keepalive_s`, so proxies and clients
with idle timeouts keep the connection while it waits. Comments are ignored by SSE parsers
(the OpenAI SDKs included). When the slot comes, the upstream's stream follows on the same
response; a refusal (or an upstream error) arrives as an SSE `error` event and `data: [DONE]`,
since the status line is already sent. A client that leaves gives its place up.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
from collections.abc import Awaitable, Callable
from typing import Literal

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from serving.gateway.admission.admitter import Admission
from serving.gateway.admission.queue_wait import ClientLeft, PendingSlot, SlotOutcome
from serving.gateway.metering.usage_meter import NOTHING_BILLED
from serving.gateway.protocol import errors
from serving.gateway.queue.fair_queue import QueueTicket
from serving.gateway.telemetry import tracing
from serving.gateway.upstream.proxy import UpstreamStream

Forward = Callable[[QueueTicket | None], Awaitable[Response]]


class _Gone(enum.Enum):
    """The client left while waiting (an enum member, so the type checker can tell it apart)."""

    GONE = enum.auto()


_GONE = _Gone.GONE


def comment(waited_s: float) -> bytes:
    return f": queued {waited_s:.0f}s\n\n".encode()


def error_events(response: Response) -> bytes:
    """An error response as SSE: its OpenAI error body as a data event, then [DONE]."""
    try:
        document = json.loads(bytes(response.body))
    except ValueError:
        document = {"error": {"message": "The request failed.", "type": "server_error", "param": None, "code": None}}
    document["error"]["status"] = response.status_code  # the status line said 200
    return f"event: error\ndata: {json.dumps(document)}\n\ndata: [DONE]\n\n".encode()


class QueuedStream(Response):
    def __init__(self, admission: Admission, forward: Forward) -> None:
        super().__init__(status_code=200, media_type="text/event-stream")
        self.headers.update(admission.headers)
        self.headers["cache-control"] = "no-cache"
        self.raw_headers = [(n, v) for n, v in self.raw_headers if n != b"content-length"]  # streamed, chunked
        assert admission.pending is not None
        self._admission, self._pending, self._forward = admission, admission.pending, forward

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pending: PendingSlot = self._pending
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        gone = asyncio.create_task(_disconnected(receive))
        try:
            with tracing.stage(tracing.QUEUE_WAIT):  # a stream's wait for its slot, after its headers
                outcome = await self._wait(pending, gone, send)
        except BaseException:
            await self._give_up(pending)
            raise
        finally:
            gone.cancel()
        # ClientLeft ends only a non-streamed wait: a stream's client going is seen here, as _GONE.
        if outcome is _GONE or isinstance(outcome, ClientLeft):
            return
        if isinstance(outcome, errors.Refusal):  # refused: the key was settled with nothing billed
            await _body(send, error_events(errors.response_for(outcome)), more=False)
            return
        pending.slot = outcome
        try:
            response = await self._forward(outcome)
        except BaseException:
            await self._admission.settle(NOTHING_BILLED)
            raise
        if isinstance(response, UpstreamStream):
            await response(scope, receive, _without_start(send))  # it settles when it ends
            return
        self._admission.meter.no_answer(response.status_code)
        await self._admission.settle(self._admission.meter.billed_usage())
        await _body(send, error_events(response), more=False)

    async def _wait(
        self, pending: PendingSlot, gone: asyncio.Task[None], send: Send
    ) -> SlotOutcome | Literal[_Gone.GONE]:
        while True:
            signal = asyncio.create_task(pending.signals.get())
            done, _ = await asyncio.wait({pending.outcome, signal, gone}, return_when=asyncio.FIRST_COMPLETED)
            signal.cancel()
            if pending.outcome in done:
                return pending.outcome.result()
            if gone in done:
                await self._give_up(pending)
                return _GONE
            await _body(send, comment(signal.result()), more=True)

    async def _give_up(self, pending: PendingSlot) -> None:
        """Leave the queue (the outcome's own handler settles the key); a slot granted at that same
        moment goes back at once."""
        pending.outcome.cancel()
        with contextlib.suppress(BaseException):
            late = await pending.outcome
            if isinstance(late, QueueTicket):
                pending.slot = late
        await self._admission.settle(NOTHING_BILLED)  # a no-op for whatever was settled already


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _body(send: Send, data: bytes, *, more: bool) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


def _without_start(send: Send) -> Send:
    async def body_only(message: Message) -> None:
        if message["type"] != "http.response.start":
            await send(message)

    return body_only
