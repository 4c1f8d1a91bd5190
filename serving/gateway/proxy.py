"""Forward an admitted request to Ray Serve's OpenAI ingress and stream the answer back.

One pooled `httpx.AsyncClient` per gateway process. Responses are relayed chunk by chunk as
they arrive (`aiter_raw`, no buffering, no decompression), so server-sent events reach the
caller token by token. When the caller goes away mid-stream the upstream response is closed,
which closes its connection and lets Ray Serve cancel the generation instead of finishing
tokens nobody reads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from serving.gateway import errors
from serving.gateway.metering import UsageMeter
from serving.gateway.metrics import GatewayMetrics
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
CONNECT_RETRIES = 2
MAX_IDLE_CONNECTIONS = 100

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                        "trailer", "transfer-encoding", "upgrade"})
# The caller's credentials end at the gateway; host and length are set anew for the upstream
# (the body is already read, so no `expect: 100-continue` either). No accept-encoding: the
# upstream then answers uncompressed, which keeps SSE flowing chunk by chunk and lets the
# later usage-settlement step read the stream it relays.
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


async def _no_settlement(billed: int) -> None:
    return None


class UpstreamStream(StreamingResponse):
    """A StreamingResponse that always closes its upstream response and settles its usage,
    however the relay ends: finished, upstream error, the client disconnecting (which cancels
    the relay), or the request's total time running out (`deadline`, time.monotonic(): the
    response is then cut, which the client sees as a broken stream, not a whole answer).
    `extra_headers` (the x-ratelimit-* set) go out before the first byte."""

    def __init__(self, upstream: httpx.Response, meter: UsageMeter, settle: Settle,
                 extra_headers: dict[str, str], *, deadline: float, metrics: GatewayMetrics) -> None:
        meter.status = upstream.status_code
        super().__init__(_relay(upstream, meter, settle, metrics), status_code=upstream.status_code)
        self._deadline, self._metrics = deadline, metrics
        # Set raw, not via a dict, so repeated headers survive.
        self.raw_headers = [(name.encode("latin-1"), value.encode("latin-1"))
                            for name, value in forwardable(upstream.headers.multi_items(), NOT_FORWARDED_DOWN)
                            if name not in extra_headers]
        self.raw_headers += [(n.encode("latin-1"), v.encode("latin-1")) for n, v in extra_headers.items()]
        self._upstream, self._meter, self._settle = upstream, meter, settle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            with anyio.move_on_after(self._deadline - time.monotonic()) as timer:
                await super().__call__(scope, receive, send)
            if timer.cancelled_caught:
                self._metrics.upstream_errors.labels(kind="total_timeout").inc()
                log.warning("request ran past its total timeout: response cut")
        finally:
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
                # A stream cut short is billed what the meter saw; a no-op if the relay settled.
                await self._settle(self._meter.billed())


async def _relay(upstream: httpx.Response, meter: UsageMeter, settle: Settle,
                 metrics: GatewayMetrics) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            out = meter.feed(chunk)
            if out:
                yield out
        held_back = meter.finish()
        # Settle before the client gets the last bytes: once it has the whole answer, its
        # refund and its freed concurrency slot are already visible to its next request.
        await settle(meter.billed())
        if held_back:
            yield held_back
    except httpx.HTTPError as exc:
        # Headers are already sent; aborting the connection (by raising) tells the client the
        # body is incomplete, where ending cleanly would pass a truncated answer off as whole.
        kind = "idle_timeout" if isinstance(exc, httpx.ReadTimeout) else "stream_broken"
        metrics.upstream_errors.labels(kind=kind).inc()
        log.warning("upstream stream broke: %s", type(exc).__name__)
        raise
    finally:
        # The client disconnecting cancels us here; shield the close so it still completes.
        with anyio.CancelScope(shield=True):
            await upstream.aclose()


class UpstreamProxy:
    def __init__(self, settings: GatewaySettings, metrics: GatewayMetrics) -> None:
        self._metrics = metrics
        self._total_timeout_s = settings.request_timeout_s
        self._client = httpx.AsyncClient(
            base_url=settings.upstream_url,
            # `read` is the idle timeout: the longest wait for the next bytes, first ones included.
            timeout=httpx.Timeout(settings.upstream_idle_timeout_s, connect=CONNECT_TIMEOUT_S, pool=CONNECT_TIMEOUT_S),
            # Retries only failed connects: the request never reached the upstream, so sending it
            # again cannot run a generation twice. Nothing is retried once the upstream has it.
            # (The pool limits go to the transport: a client given a transport ignores its own.)
            transport=httpx.AsyncHTTPTransport(
                retries=CONNECT_RETRIES,
                limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_IDLE_CONNECTIONS,
                                    keepalive_expiry=KEEPALIVE_EXPIRY_S)),
            headers={"accept-encoding": "identity"},  # see NOT_FORWARDED_UP
            follow_redirects=False,
            trust_env=False,  # HTTP(S)_PROXY in the pod's environment must not reroute model traffic
        )

    async def forward(self, request: Request, body: bytes, *, meter: UsageMeter | None = None,
                      settle: Settle = _no_settlement, extra_headers: dict[str, str] | None = None) -> Response:
        """Send `request` (with the already-read `body`) upstream; stream the response back.
        `settle(billed_tokens)` is called once the response ends; the caller settles itself
        when this returns an error response instead of an `UpstreamStream`."""
        deadline = time.monotonic() + self._total_timeout_s
        path = request.url.path
        if not is_safe_api_path(path):
            return errors.not_found(path)
        upstream_request = self._client.build_request(
            request.method,
            httpx.URL(path=path, query=request.url.query.encode() or None),
            headers=forwardable(request.headers.items(), NOT_FORWARDED_UP),
            content=body,
        )
        try:
            with anyio.fail_after(self._total_timeout_s):
                upstream = await self._client.send(upstream_request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            return self._failed("unavailable", exc, errors.upstream_unavailable())
        except (httpx.TimeoutException, TimeoutError) as exc:
            kind = "idle_timeout" if isinstance(exc, httpx.TimeoutException) else "total_timeout"
            return self._failed(kind, exc, errors.upstream_timeout())
        except httpx.HTTPError as exc:
            return self._failed("failed", exc, errors.upstream_failed())
        meter = meter or UsageMeter(stream=False, strip_usage=False, prompt_estimate=0, reserved=0)
        return UpstreamStream(upstream, meter, settle, extra_headers or {}, deadline=deadline, metrics=self._metrics)

    def _failed(self, kind: str, exc: Exception, response: Response) -> Response:
        self._metrics.upstream_errors.labels(kind=kind).inc()
        log.warning("upstream request failed (%s): %s", kind, type(exc).__name__)
        return response

    async def aclose(self) -> None:
        await self._client.aclose()
