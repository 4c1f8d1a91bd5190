"""A completion whose replica died before answering is sent once more.

Before answering means before the response headers. vLLM generates a non-streamed answer whole
before sending a byte, and Ray Serve LLM's ingress sends a stream's headers only with its first
chunk (it peeks at the generator to turn an engine error into an error status:
ray.llm._internal.serve.core.ingress.ingress, `_peek_at_generator`), so a replica lost while it
worked on either (a stream still in its prefill) leaves the client with nothing yet: no
connection reset, or HAProxy's 502/503 in front of Serve, which Ray's HAProxy config serves as a
plain-text 500 (serving.gateway.resume.ending.replica_unavailable). The request is sent again, the same way,
once, within the request's own deadline (the caller's `fail_after`), and Serve routes it to a
live replica. A stream that breaks after its headers is resumed instead
(serving.gateway.upstream.resuming_relay). Only with `gateway.stream_resume` on, which is the
stack saying its models may be asked twice. The tenant is billed the answer it gets (the meter
reads only the second response); what the first attempt generated is the platform's. Failed
connects are not this module's: the proxy's session already retries those, since such a request
never reached the upstream.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import aiohttp

from serving.gateway.resume.ending import replica_unavailable

log = logging.getLogger("llmstack.gateway.resume")


def lost_replica(exc: BaseException) -> bool:
    """The request reached an upstream that then went away without answering."""
    if isinstance(exc, aiohttp.ClientConnectorError):  # never connected: retried by the session
        return False
    return isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError))


async def answered(
    request: Callable[[], Awaitable[aiohttp.ClientResponse]], *, again: bool, on_retry: Callable[[str], None]
) -> aiohttp.ClientResponse:
    """`request()`'s response; when `again`, a second try if the first lost its replica
    (`on_retry(reason)` is told why)."""
    try:
        response = await request()
    except aiohttp.ClientError as exc:
        if not again or not lost_replica(exc):
            raise
        reason = "connection_reset"
    else:
        if not again or not replica_unavailable(response.status, response.content_type, response.content_length):
            return response
        response.close()
        reason = "upstream_unavailable"
    on_retry(reason)
    log.warning("upstream lost a non-streamed request before answering (%s): sent once more", reason)
    return await request()
