"""Why an upstream stream ended, and whether that end is one a continuation may follow.

Only an end that is neither the answer's nor the client's is resumed: the replica or the path to
it failed while the answer was still being generated. A clean end marker (`data: [DONE]`) or a
clean error event is the upstream's answer and is relayed as is, except a server-side error
event (`is_engine_error_event`: vLLM's 5xx `InternalServerError`/`ServiceUnavailableError`, what a
stream gets when its engine stops under it: the replica's graceful shutdown ran out and stopped
the engine, or the engine process died while the replica lived), which the relay holds back from
the client and resumes like a cut. A client that goes away is never
a reason to resume, whatever else happened: resuming it would generate tokens nobody reads, and
let a caller that cuts its own streams have them continued (and the cut part re-prefilled) at
the platform's cost. The request's own total deadline running out is not resumed either: a
continuation could not finish within it.

`cut_of` maps what the relay's read raised (aiohttp) to a `Cut`: the relay passes it, with what
it saw, to `classify`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import aiohttp


class Cut(Enum):
    """How the upstream's bytes stopped, as the relay saw it."""

    NONE = "none"  # the body ended normally (whether or not it held an end marker)
    CONNECTION_RESET = "connection_reset"  # reset, or closed in the middle of the body
    IDLE_TIMEOUT = "idle_timeout"  # no bytes within the idle timeout
    TOTAL_TIMEOUT = "total_timeout"  # the request's own deadline
    OTHER = "other"  # anything else the read raised


class EndReason(Enum):
    """Why the stream ended. The values are the `reason` label of the resume metric."""

    DONE = "done"
    ERROR_EVENT = "error_event"
    ENGINE_ERROR = "engine_error"  # a 5xx error event: the engine failed or stopped under the stream
    CLIENT_GONE = "client_gone"
    TOTAL_TIMEOUT = "total_timeout"
    ALL_FINISHED = "all_finished"  # no end marker, but every choice had finished: nothing to continue
    CONNECTION_RESET = "connection_reset"
    EOF_WITHOUT_DONE = "eof_without_done"
    IDLE_TIMEOUT = "idle_timeout"
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"  # 502/503 where the stream should have been
    UPSTREAM_FAILED = "upstream_failed"  # any other failure: not known to be a lost replica


RESUMABLE = frozenset(
    {
        EndReason.CONNECTION_RESET,
        EndReason.EOF_WITHOUT_DONE,
        EndReason.IDLE_TIMEOUT,
        EndReason.UPSTREAM_UNAVAILABLE,
        EndReason.ENGINE_ERROR,
    }
)
# vLLM's error types for a failure of the server, not of the request
# (vllm/entrypoints/serve/exception_handling/error_response.py): GenerationError, EngineDeadError
# and EngineGenerateError are InternalServerError (500), RetryableRequestError ServiceUnavailableError (503).
ENGINE_ERROR_TYPES = frozenset({"InternalServerError", "ServiceUnavailableError"})
# HAProxy answers 502 when a server drops a request it had taken, 503 when no server is up (yet).
UNAVAILABLE_STATUSES = frozenset({502, 503})
# Ray Serve's HAProxy does not send those as they are: its config serves one page for 502, 503
# and 504 (`errorfile` lines of ray/serve/_private/haproxy_templates.py; the page is written by
# haproxy.py): status 500, `Content-Type: text/plain`, body "Internal Server Error". A replica
# lost before answering reaches the gateway as that page. vLLM's own errors are JSON, and a Serve
# replica's unhandled-exception 500 carries the same text without a content type, so the page is
# told apart by its header and length, without reading a body the error path still has to relay.
RAY_HAPROXY_ERROR_PAGE = b"Internal Server Error"


def replica_unavailable(status: int, content_type: str | None, content_length: int | None) -> bool:
    """The upstream answered that no replica took the request: HAProxy's 502/503, or Ray's page for them."""
    if status in UNAVAILABLE_STATUSES:
        return True
    return status == 500 and content_type == "text/plain" and content_length == len(RAY_HAPROXY_ERROR_PAGE)


@dataclass(frozen=True)
class StreamEnd:
    """What the relay saw when the upstream stopped sending: `status` is the upstream response's
    (a continuation's may be 502/503, or Ray's page for them, while the client's 200 is long gone out)."""

    client_gone: bool = False
    saw_done: bool = False
    saw_error_event: bool = False
    all_finished: bool = False
    cut: Cut = Cut.NONE
    status: int = 200
    engine_error: bool = False  # a server-side error event came (held back from the client)
    unavailable: bool = False  # the status is Ray's HAProxy page for a 502/503 (`replica_unavailable`)


def is_engine_error_event(chunk: dict[str, Any]) -> bool:
    """An SSE error event that reports a failure of the server rather than of the request: a
    5xx `code`, or one of vLLM's server-side error types."""
    error = chunk.get("error")
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return (isinstance(code, int) and 500 <= code < 600) or error.get("type") in ENGINE_ERROR_TYPES


def classify(end: StreamEnd) -> EndReason:
    """The reason, in precedence order: the client first (never resumed), then the upstream's
    own clean ends, then the deadline, then the failures that can be resumed."""
    if end.client_gone:
        return EndReason.CLIENT_GONE
    if end.engine_error and end.cut is not Cut.TOTAL_TIMEOUT:  # its [DONE] ends a failure, not an answer
        return EndReason.ENGINE_ERROR
    if end.saw_done:
        return EndReason.DONE
    if end.saw_error_event:
        return EndReason.ERROR_EVENT
    if end.cut is Cut.TOTAL_TIMEOUT:
        return EndReason.TOTAL_TIMEOUT
    if end.unavailable or end.status in UNAVAILABLE_STATUSES:
        return EndReason.UPSTREAM_UNAVAILABLE
    if end.status >= 300:
        return EndReason.UPSTREAM_FAILED
    if end.all_finished:
        return EndReason.ALL_FINISHED
    if end.cut is Cut.CONNECTION_RESET:
        return EndReason.CONNECTION_RESET
    if end.cut is Cut.IDLE_TIMEOUT:
        return EndReason.IDLE_TIMEOUT
    if end.cut is Cut.NONE:
        return EndReason.EOF_WITHOUT_DONE
    return EndReason.UPSTREAM_FAILED


def cut_of(exc: BaseException | None) -> Cut:
    """What a read of the upstream body raising `exc` means (None: it ended without raising).
    aiohttp raises `ClientPayloadError` for a body closed before its end (a chunked body without
    its last chunk: a replica killed mid-answer), `ServerDisconnectedError` or an OS reset for a
    dropped connection, and `ServerTimeoutError` (a `TimeoutError`) when sock_read runs out.
    A bare `TimeoutError` is the relay's deadline (anyio)."""
    if exc is None:
        return Cut.NONE
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return Cut.IDLE_TIMEOUT
    if isinstance(exc, TimeoutError):
        return Cut.TOTAL_TIMEOUT
    if isinstance(
        exc, (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, ConnectionError)
    ):
        return Cut.CONNECTION_RESET
    return Cut.OTHER
