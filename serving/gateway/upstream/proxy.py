"""Forward an admitted request to Ray Serve's OpenAI ingress and stream the answer back.

One pooled `aiohttp.ClientSession` per gateway process (created on first use, inside the
server's event loop). aiohttp rather than httpx: on this project's machines httpx spent about
3.4-3.8 ms of CPU per proxied request with 50 in flight, aiohttp 0.15 ms (ops.benchmarks.http_clients), and the
gateway's whole budget is about a millisecond. Responses are relayed chunk by chunk as they
arrive (no buffering, no decompression), so server-sent events reach the caller token by
token. When the caller goes away mid-stream the upstream response is closed, which closes its
connection and lets Ray Serve cancel the generation instead of finishing tokens nobody reads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import anyio
from aiohttp_retry import ExponentialRetry, RetryClient
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send
from yarl import URL

from serving.gateway.auth.adapter_access import ServedModel
from serving.gateway.capacity.recorder import LatencyRecorder, StreamTimer
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.metering.reservation import COMPLETION_PATHS
from serving.gateway.metering.usage_meter import Usage, UsageMeter
from serving.gateway.protocol import errors, upstream_errors
from serving.gateway.protocol.routes import MODELS, ApiRoute, upstream_prefix_for
from serving.gateway.resume.request import ResumableStream
from serving.gateway.telemetry import tracing
from serving.gateway.telemetry.access_log import REQUEST_ID_HEADER
from serving.gateway.telemetry.metrics import GatewayMetrics
from serving.gateway.upstream.answer_retry import answered
from serving.gateway.upstream.resuming_relay import ResumingRelay, resuming_relay

log = logging.getLogger("llmstack.gateway.proxy")

# Fail fast when the upstream is down: clients get a 503 + Retry-After instead of hanging.
CONNECT_TIMEOUT_S = 2.0
# Shorter than uvicorn's default 5 s keep-alive (Ray Serve's proxy runs uvicorn): we drop an
# idle pooled connection before the upstream does, so we never send a request on a socket
# the server is closing at that same moment (which surfaces as a spurious connection error).
KEEPALIVE_EXPIRY_S = 4.0
# Streams are long-lived: the pool must hold many at once; admission limits load, not this.
MAX_CONNECTIONS = 1000
# Only failed connects are retried: the request never reached the upstream, so sending it
# again cannot run a generation twice. Nothing is retried once the upstream has it.
CONNECT_RETRY = ExponentialRetry(
    attempts=3,
    start_timeout=0.05,
    methods={"GET", "POST"},
    statuses=set(),
    retry_all_server_errors=False,
    exceptions={aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError},
)

# Request headers are an allowlist: vLLM and Ray Serve read some as engine inputs
# (x-request-id, X-data-parallel-rank, priority and session headers, Ray's multiplexed model
# id), so a client's headers stay at the gateway unless listed here or in the stack's
# forward_request_headers. The caller's credentials end at the gateway; host and length are
# set anew; x-request-id is the gateway's own (serving.gateway.telemetry.access_log) and
# accept-encoding is `identity`, so the upstream answers uncompressed, which keeps SSE
# flowing chunk by chunk and lets usage settlement read the stream it relays.
FORWARDED_UP = frozenset({"content-type", "accept"})
# Response headers too: only what describes the body. Length is dropped because the relayed
# body is streamed (chunked) and may end early; x-request-id is set by the access log.
FORWARDED_DOWN = frozenset({"content-type", "cache-control"})
ERROR_BODY_LIMIT = 64 * 1024  # enough for an error message; the rest is never read
MODEL_LIST_LIMIT = 1024 * 1024
# An answer whose whole body came with its headers is relayed in one message when it is at most
# this long: below the transport's write buffer limit, so sending it never waits on the client.
WHOLE_ANSWER_BYTES = 64 * 1024


def forwardable(headers: Iterable[tuple[str, str]], allowed: frozenset[str]) -> list[tuple[str, str]]:
    """The headers named in `allowed`, minus any the Connection header names (RFC 9110 7.6.1)."""
    pairs = [(name.lower(), value) for name, value in headers]
    named = {token.strip().lower() for name, value in pairs if name == "connection" for token in value.split(",")}
    return [(name, value) for name, value in pairs if name in allowed and name not in named]


def visible_models(document: object, allowed: Iterable[str]) -> object:
    """A model list (`{"object": "list", "data": [...]}`) with only the models in `allowed`."""
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        return document
    allowed = frozenset(allowed)
    data = [card for card in document["data"] if isinstance(card, dict) and card.get("id") in allowed]
    return {**document, "data": data}


def adapter_card(adapter: ServedModel, base_card: Mapping[str, Any]) -> dict[str, Any]:
    """An adapter's entry in the model list, OpenAI's model object (id, object, created, owned_by)
    plus vLLM's `parent` (the base). Built by the gateway, never relayed: Ray's adapter card carries
    the adapter's bucket URI in its metadata, and vLLM's `root` is the adapter's local path."""
    created = base_card.get("created")
    return {
        "id": adapter.name,
        "object": "model",
        "created": created if isinstance(created, int) and not isinstance(created, bool) else 0,
        "owned_by": str(base_card.get("owned_by") or "llmstack"),
        "parent": adapter.base,
    }


def listed_models(document: object, bases: Iterable[str] | None, adapters: Sequence[ServedModel]) -> object:
    """The model list a caller gets: the upstream's cards of the base models it may use (`bases`;
    None: every card that is not an adapter's), then exactly the `adapters` it may use whose base
    is listed, each with a card of the gateway's own (`adapter_card`)."""
    if not isinstance(document, dict) or not isinstance(document.get("data"), list):
        return document
    cards = [card for card in document["data"] if isinstance(card, dict) and isinstance(card.get("id"), str)]
    if bases is None:
        kept = [card for card in cards if ":" not in card["id"]]
    else:
        allowed = frozenset(bases)
        kept = [card for card in cards if card["id"] in allowed]
    by_id = {card["id"]: card for card in kept}
    extra = [adapter_card(a, by_id[a.base]) for a in adapters if a.base in by_id]
    return {**document, "data": kept + extra}


Settle = Callable[[Usage], Awaitable[None]]


class UpstreamStream(Response):
    """A streamed response that always closes its upstream response and settles its usage,
    however the relay ends: finished, upstream error, the client disconnecting (which cancels
    the relay), or the request's total time running out (`deadline`, time.monotonic(): the
    response is then cut, which the client sees as a broken stream, not a whole answer).
    `extra_headers` (the x-ratelimit-* set) go out before the first byte.

    The client is watched by its transport, not by `send()`: once a connection is lost, uvicorn's
    `send()` returns without error and without sending, so a relay that took it for "the client
    took it" would go on draining the upstream into nothing. A watcher waits on `receive()` for
    `http.disconnect` (which also comes while the upstream is silent) and cancels the relay,
    which also stops after any `send()` that returns once the client is known gone. The meter
    bills such a cut stream its reservation unless it saw every sequence finish
    (serving.gateway.metering.usage_meter).

    The relay itself is a plain loop over the upstream's reads: direct streaming sends one event
    per token, so everything done per read is done per token. Each read goes to the client as
    one message, however many whole events it holds, the moment it is read."""

    def __init__(
        self,
        upstream: aiohttp.ClientResponse,
        meter: UsageMeter,
        settle: Settle,
        extra_headers: dict[str, str],
        *,
        deadline: float,
        metrics: GatewayMetrics,
        timer: StreamTimer | None = None,
        resume: Callable[[Callable[[], bool], StreamTimer], ResumingRelay] | None = None,
    ) -> None:
        meter.status = upstream.status
        super().__init__(status_code=upstream.status)
        # Raw pairs, not a dict, so repeated headers survive.
        pairs = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in upstream.raw_headers]
        self.raw_headers = [
            (name.encode("latin-1"), value.encode("latin-1"))
            for name, value in forwardable(pairs, FORWARDED_DOWN)
            if name not in extra_headers
        ]
        self.raw_headers += [(n.encode("latin-1"), v.encode("latin-1")) for n, v in extra_headers.items()]
        self._upstream, self._meter, self._settle = upstream, meter, settle
        self._deadline, self._metrics = deadline, metrics
        self._client_gone = False
        self._timer = timer or StreamTimer(None, 0.0)  # TTFT and ITL for the adaptive capacity
        # A resumable stream's continuation of a broken upstream (serving.gateway.upstream.resuming_relay).
        self._resuming = None if resume is None else resume(lambda: self._client_gone, self._timer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with tracing.stage(tracing.RELAY):  # the relay and how it ends (close, settle): one stage
            await self._relay(receive, send)

    async def _relay(self, receive: Receive, send: Send) -> None:
        try:
            if await self._relay_whole(send):
                return
            with anyio.move_on_after(self._deadline - time.monotonic()) as timer:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._watch_client, receive, group.cancel_scope)
                    await self.stream_response(send)
                    group.cancel_scope.cancel()  # the relay ended: stop watching
            if timer.cancelled_caught:
                self._metrics.upstream_errors.labels(kind="total_timeout").inc()
                log.warning("request ran past its total timeout: response cut")
        finally:
            self._timer.end()
            with anyio.CancelScope(shield=True):
                self._upstream.close()  # a no-op after a full read (the connection went back to the pool)
                # A stream cut short is billed what the meter says of it; a no-op if the relay settled.
                await self._settle(self._meter.billed_usage())

    async def _relay_whole(self, send: Send) -> bool:
        """Relay an answer that arrived whole with its headers (a non-streamed answer usually
        does), and say whether it did. Nothing is left to wait for, so neither the client
        watcher nor the deadline has anything to cut: the answer is metered, settled, and sent
        in one message after the headers (two writes to the client instead of three). At most
        `WHOLE_ANSWER_BYTES`, so no send can wait on a client that does not read."""
        content = self._upstream.content
        if (
            self._resuming is not None
            or not content.is_eof()
            or content.exception() is not None
            or content.total_bytes > WHOLE_ANSWER_BYTES
        ):
            return False
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        meter, chunk = self._meter, content.read_nowait()
        out = meter.feed(chunk) if chunk else b""
        if out and meter.stream and meter.usage is None:  # as the relay's loop times a read
            self._timer.chunk(time.monotonic())
        self._upstream.release()
        held_back = meter.finish()
        await self._settle(meter.billed_usage())  # before the client has the answer, as below
        await send({"type": "http.response.body", "body": out + held_back, "more_body": False})
        return True

    async def _watch_client(self, receive: Receive, relay: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self._client_gone = True
        relay.cancel()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        upstream, meter = self._upstream, self._meter
        try:
            while True:
                chunk = await upstream.content.readany()  # all that has arrived; b"" at the end
                if not chunk:
                    break
                out = meter.feed(chunk)
                if out and meter.stream and meter.usage is None:  # tokens, not [DONE] nor the final usage
                    self._timer.chunk(time.monotonic())
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                    if self._client_gone:  # that send went nowhere: relay nothing more
                        return
            upstream.release()  # fully read: its connection goes back to the pool
            # Ended without its end marker, or with a server-side error event held back from the client.
            if self._resuming is not None and (not meter.done_seen or self._resuming.interrupted):
                await self._resuming.carry_on(None, send)
                return
            held_back = meter.finish()
            # Settle before the client gets the last bytes: once it has the whole answer, its
            # refund and its freed concurrency slot are already visible to its next request.
            await self._settle(meter.billed_usage())
            await send({"type": "http.response.body", "body": held_back, "more_body": False})
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Headers are already sent; aborting the connection (by raising) tells the client the
            # body is incomplete, where ending cleanly would pass a truncated answer off as whole.
            kind = "idle_timeout" if isinstance(exc, TimeoutError) else "stream_broken"
            self._metrics.upstream_errors.labels(kind=kind).inc()
            log.warning("upstream stream broke: %s", type(exc).__name__)
            if self._resuming is None:
                raise
            upstream.close()
            await self._resuming.carry_on(exc, send)
        finally:
            upstream.close()  # the client disconnecting cancels us here: drop the connection, never reuse it


class UpstreamProxy:
    def __init__(
        self, settings: GatewaySettings, metrics: GatewayMetrics, timers: LatencyRecorder | None = None
    ) -> None:
        self._settings, self._metrics = settings, metrics
        self._timers = timers or LatencyRecorder(())  # none: no model's latency is measured
        self._client: RetryClient | None = None

    def _session(self) -> RetryClient:
        if self._client is None:  # here, not in __init__: aiohttp binds the session to the running loop
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_EXPIRY_S),
                # sock_read is the idle timeout: the longest wait for the next bytes, first ones included.
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=self._settings.upstream_idle_timeout_s
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                trust_env=False,  # HTTP(S)_PROXY in the pod's environment must not reroute model traffic
            )
            self._client = RetryClient(session, retry_options=CONNECT_RETRY, raise_for_status=False)
        return self._client

    async def forward(
        self,
        request: Request,
        route: ApiRoute,
        body: bytes,
        *,
        meter: UsageMeter,
        settle: Settle,
        extra_headers: dict[str, str],
        model: str | None = None,
        model_list: Callable[[object], object] | None = None,
        first_byte_timeout_s: float | None = None,
        held: AsyncExitStack | None = None,
        resume: ResumableStream | None = None,
    ) -> Response:
        """Send `route` (with the already-read `body`) upstream; stream the response back.
        Only the route's canonical path goes upstream, already encoded: never the caller's
        spelling of it, nor its query string. `settle(billed_usage)` is called once the
        response ends; the caller settles itself when this returns anything but an
        `UpstreamStream` (an error, or the model list as `model_list` makes it for the caller).
        `model`: the model whose own Serve application (its route prefix in `model_routes`) gets
        the request: the one the body names, or an adapter's base. `first_byte_timeout_s`: the idle timeout for a model
        that may be starting from zero replicas (its cold start) instead of
        `upstream_idle_timeout_s`. `resume`: a stream to continue on another replica if its
        upstream breaks (serving.gateway.upstream.resuming_relay). `held`: the request's exit
        stack, which then holds the upstream connection too (closed with it, unless an
        `UpstreamStream` takes it over: the caller pops the stack then; a connection already
        given back to the pool is not closed again)."""
        total_timeout_s = self._settings.request_timeout_s
        deadline = time.monotonic() + total_timeout_s
        prefix = upstream_prefix_for(model, self._settings.model_routes)
        url = URL(self._settings.upstream_url + prefix + route.path, encoded=True)
        allowed = FORWARDED_UP | frozenset(self._settings.forward_request_headers) | {REQUEST_ID_HEADER}
        headers = forwardable(request.headers.items(), allowed) + [("accept-encoding", "identity")]
        headers = tracing.inject_upstream(headers)  # the upstream's spans are children of the current stage's
        # aiohttp has one read timeout for the first byte and the gaps after it: a cold model's
        # request gets the longer one for both.
        timeout: dict[str, Any] = (
            {}
            if first_byte_timeout_s is None
            else {
                "timeout": aiohttp.ClientTimeout(
                    total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=first_byte_timeout_s
                )
            }
        )
        sent = time.monotonic()  # the TTFT counts from here: after any wait in the gateway's queue
        try:
            # asyncio's timeout rather than anyio's cancel scope: the same TimeoutError for less CPU.
            # It cancels once (anyio's keeps cancelling), which is enough: nothing inside catches
            # the cancellation (aiohttp, aiohttp_retry and `answered` catch Exceptions only).
            async with asyncio.timeout(total_timeout_s):
                upstream = await answered(
                    lambda: self._session().request(
                        route.method,
                        url,
                        data=body if route.takes_body else None,
                        headers=headers,
                        allow_redirects=False,
                        **timeout,
                    ),
                    again=self._retries_answer(route),
                    on_retry=self._count_retry(model),
                )
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            return self._failed("unavailable", exc, errors.upstream_unavailable())
        except TimeoutError as exc:  # aiohttp's read timeouts are TimeoutErrors too
            kind = "idle_timeout" if isinstance(exc, aiohttp.ServerTimeoutError) else "total_timeout"
            return self._failed(kind, exc, errors.upstream_timeout())
        except aiohttp.ClientError as exc:
            return self._failed("failed", exc, errors.upstream_failed())
        if held is not None:
            held.callback(upstream.close)
        if upstream.status >= 300:
            with tracing.stage(tracing.RELAY):
                return await self._rewritten(upstream, deadline)
        if route.path == MODELS and model_list is not None:
            with tracing.stage(tracing.RELAY):
                return await self._model_list(upstream, model_list, deadline)
        resuming = (
            None
            if resume is None
            else resuming_relay(
                resume,
                request=self._session().request,
                base_url=self._settings.upstream_url + prefix,
                headers=headers,
                options=timeout,
                meter=meter,
                settle=settle,
                metrics=self._metrics,
                model=model,
                deadline=deadline,
            )
        )
        return UpstreamStream(
            upstream,
            meter,
            settle,
            extra_headers,
            deadline=deadline,
            metrics=self._metrics,
            timer=self._timers.start(model, sent),
            resume=resuming,
        )

    def _retries_answer(self, route: ApiRoute) -> bool:
        """A completion is sent once more if its replica dies before the response headers
        (serving.gateway.upstream.answer_retry): a non-streamed answer, or a stream still in its
        prefill; a stream that broke after its headers is resumed instead."""
        return self._settings.stream_resume.active and route.path in COMPLETION_PATHS

    def _count_retry(self, model: str | None) -> Callable[[str], None]:
        label = self._metrics.model_label(model)
        return lambda reason: self._metrics.answer_retries.labels(model=label, reason=reason).inc()

    async def _rewritten(self, upstream: aiohttp.ClientResponse, deadline: float) -> Response:
        """An upstream redirect or error as our own OpenAI error (serving.gateway.protocol.upstream_errors).
        Only the status and the exception type go to the log: the body may echo a prompt."""
        body = await _read_some(upstream, ERROR_BODY_LIMIT, deadline)
        if upstream.status >= 500 or upstream.status < 400:
            self._metrics.upstream_errors.labels(kind="error_status").inc()
        log.warning("upstream answered %d (%s): relayed as an OpenAI error of ours", upstream.status, _error_type(body))
        return errors.response_for(upstream_errors.rewritten(upstream.status, body))

    async def _model_list(
        self, upstream: aiohttp.ClientResponse, model_list: Callable[[object], object], deadline: float
    ) -> Response:
        body = await _read_some(upstream, MODEL_LIST_LIMIT + 1, deadline)
        try:
            document = json.loads(body) if len(body) <= MODEL_LIST_LIMIT else None
        except ValueError:
            document = None
        if document is None:
            return self._failed("failed", ValueError("model list unreadable"), errors.upstream_failed())
        return JSONResponse(model_list(document))

    def _failed(self, kind: str, exc: Exception, refusal: errors.Refusal) -> Response:
        self._metrics.upstream_errors.labels(kind=kind).inc()
        log.warning("upstream request failed (%s): %s", kind, type(exc).__name__)
        return errors.response_for(refusal)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()


async def _read_some(upstream: aiohttp.ClientResponse, limit: int, deadline: float) -> bytes:
    """Up to `limit` bytes of a response body (less if it breaks or the deadline passes). A body
    read to its end gives its connection back to the pool; otherwise the connection is closed,
    since the rest of the body is still on it."""
    parts: list[bytes] = []
    size, whole = 0, False
    try:
        with anyio.move_on_after(deadline - time.monotonic()):
            while size < limit:
                chunk = await upstream.content.read(limit - size)
                if not chunk:
                    whole = True
                    break
                parts.append(chunk)
                size += len(chunk)
    except (aiohttp.ClientError, TimeoutError):
        pass
    finally:
        if whole:
            upstream.release()
        else:
            upstream.close()
    return b"".join(parts)


def _error_type(body: bytes) -> str:
    """The `error.type` of an upstream error body (an exception class name for Ray), for logs."""
    try:
        kind = json.loads(body)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return "no error type"
    return str(kind)[:80]
