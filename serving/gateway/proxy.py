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

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import aiohttp
import anyio
from aiohttp_retry import ExponentialRetry, RetryClient
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from serving.gateway import errors
from serving.gateway.metering import UsageMeter
from serving.gateway.metrics import GatewayMetrics
from serving.gateway.routes import upstream_prefix_for
from serving.gateway.settings import GatewaySettings

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
CONNECT_RETRY = ExponentialRetry(attempts=3, start_timeout=0.05, methods={"GET", "POST"}, statuses=set(),
                                 retry_all_server_errors=False,
                                 exceptions={aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError})

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade"})
# The caller's credentials end at the gateway; host and length are set anew for the upstream
# (the body is already read, so no `expect: 100-continue` either). The caller's accept-encoding
# is replaced by `identity`: the upstream then answers uncompressed, which keeps SSE flowing
# chunk by chunk and lets usage settlement read the stream it relays.
NOT_FORWARDED_UP = HOP_BY_HOP | {"authorization", "x-api-key", "cookie", "host", "content-length", "expect",
                                 "accept-encoding"}
# Length is dropped because the relayed body is streamed (chunked) and may end early; `server`
# because what runs behind the gateway is nobody else's business.
NOT_FORWARDED_DOWN = HOP_BY_HOP | {"content-length", "set-cookie", "server"}


def forwardable(headers: Iterable[tuple[str, str]], dropped: frozenset[str]) -> list[tuple[str, str]]:
    """Headers minus `dropped` and minus any header the Connection header names (RFC 9110 7.6.1)."""
    pairs = [(name.lower(), value) for name, value in headers]
    named = {token.strip().lower() for name, value in pairs if name == "connection" for token in value.split(",")}
    return [(name, value) for name, value in pairs if name not in dropped and name not in named]


def is_safe_api_path(path: str) -> bool:
    """Only plain /v1/... paths go upstream: no dot segments that could climb out of /v1."""
    segments = path.split("/")
    return path.startswith("/v1/") and not any(s in (".", "..") for s in segments) and "\\" not in path


Settle = Callable[[int], Awaitable[None]]


class UpstreamStream(StreamingResponse):
    """A StreamingResponse that always closes its upstream response and settles its usage,
    however the relay ends: finished, upstream error, the client disconnecting (which cancels
    the relay), or the request's total time running out (`deadline`, time.monotonic(): the
    response is then cut, which the client sees as a broken stream, not a whole answer).
    `extra_headers` (the x-ratelimit-* set) go out before the first byte."""

    def __init__(self, upstream: aiohttp.ClientResponse, meter: UsageMeter, settle: Settle,
                 extra_headers: dict[str, str], *, deadline: float, metrics: GatewayMetrics) -> None:
        meter.status = upstream.status
        super().__init__(_relay(upstream, meter, settle, metrics), status_code=upstream.status)
        # Raw pairs, not a dict, so repeated headers survive.
        pairs = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in upstream.raw_headers]
        self.raw_headers = [(name.encode("latin-1"), value.encode("latin-1"))
                            for name, value in forwardable(pairs, NOT_FORWARDED_DOWN) if name not in extra_headers]
        self.raw_headers += [(n.encode("latin-1"), v.encode("latin-1")) for n, v in extra_headers.items()]
        self._upstream, self._meter, self._settle = upstream, meter, settle
        self._deadline, self._metrics = deadline, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with anyio.move_on_after(self._deadline - time.monotonic()) as timer:
                await super().__call__(scope, receive, send)
            if timer.cancelled_caught:
                self._metrics.upstream_errors.labels(kind="total_timeout").inc()
                log.warning("request ran past its total timeout: response cut")
        finally:
            with anyio.CancelScope(shield=True):
                self._upstream.close()  # a no-op after a full read (the connection went back to the pool)
                # A stream cut short is billed what the meter saw; a no-op if the relay settled.
                await self._settle(self._meter.billed())


async def _relay(upstream: aiohttp.ClientResponse, meter: UsageMeter, settle: Settle,
                 metrics: GatewayMetrics) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.content.iter_any():
            out = meter.feed(chunk)
            if out:
                yield out
        upstream.release()  # fully read: its connection goes back to the pool
        held_back = meter.finish()
        # Settle before the client gets the last bytes: once it has the whole answer, its
        # refund and its freed concurrency slot are already visible to its next request.
        await settle(meter.billed())
        if held_back:
            yield held_back
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Headers are already sent; aborting the connection (by raising) tells the client the
        # body is incomplete, where ending cleanly would pass a truncated answer off as whole.
        kind = "idle_timeout" if isinstance(exc, TimeoutError) else "stream_broken"
        metrics.upstream_errors.labels(kind=kind).inc()
        log.warning("upstream stream broke: %s", type(exc).__name__)
        raise
    finally:
        upstream.close()  # the client disconnecting cancels us here: drop the connection, never reuse it


class UpstreamProxy:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self._settings, self._metrics = settings, metrics
        self._client: RetryClient | None = None

    def _session(self) -> RetryClient:
        if self._client is None:  # here, not in __init__: aiohttp binds the session to the running loop
            session = aiohttp.ClientSession(
                base_url=self._settings.upstream_url,
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS, keepalive_timeout=KEEPALIVE_EXPIRY_S),
                # sock_read is the idle timeout: the longest wait for the next bytes, first ones included.
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S,
                                              sock_read=self._settings.upstream_idle_timeout_s),
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                trust_env=False,  # HTTP(S)_PROXY in the pod's environment must not reroute model traffic
            )
            self._client = RetryClient(session, retry_options=CONNECT_RETRY, raise_for_status=False)
        return self._client

    async def forward(self, request: Request, body: bytes, *, meter: UsageMeter, settle: Settle,
                      extra_headers: dict[str, str], model: str | None = None) -> Response:
        """Send `request` (with the already-read `body`) upstream; stream the response back.
        `settle(billed_tokens)` is called once the response ends; the caller settles itself
        when this returns an error response instead of an `UpstreamStream`."""
        total_timeout_s = self._settings.request_timeout_s
        deadline = time.monotonic() + total_timeout_s
        path = request.url.path
        if not is_safe_api_path(path):
            return errors.not_found(path)
        headers = forwardable(request.headers.items(), NOT_FORWARDED_UP) + [("accept-encoding", "identity")]
        target = upstream_prefix_for(model, self._settings.model_routes) + path
        target += f"?{request.url.query}" if request.url.query else ""
        try:
            with anyio.fail_after(total_timeout_s):
                upstream = await self._session().request(request.method, target, data=body, headers=headers,
                                                         allow_redirects=False)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            return self._failed("unavailable", exc, errors.upstream_unavailable())
        except TimeoutError as exc:  # aiohttp's read timeouts are TimeoutErrors too
            kind = "idle_timeout" if isinstance(exc, aiohttp.ServerTimeoutError) else "total_timeout"
            return self._failed(kind, exc, errors.upstream_timeout())
        except aiohttp.ClientError as exc:
            return self._failed("failed", exc, errors.upstream_failed())
        return UpstreamStream(upstream, meter, settle, extra_headers, deadline=deadline, metrics=self._metrics)

    def _failed(self, kind: str, exc: Exception, response: Response) -> Response:
        self._metrics.upstream_errors.labels(kind=kind).inc()
        log.warning("upstream request failed (%s): %s", kind, type(exc).__name__)
        return response

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.close()
