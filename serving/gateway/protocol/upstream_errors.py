"""The upstream's redirects and errors, rewritten into OpenAI errors that name nothing internal.

What Ray Serve LLM sends cannot be relayed as is. Its error bodies are built by
`ray/llm/_internal/serve/utils/server_utils.py` `get_response_for_error` (ray 2.60) as
"Message: ..., Internal exception: ..., original exception: ..." with the exception's class
name as `type`, and its validation handler echoes the caller's input as `param`; a vLLM
validation message arrives inside that same wrapper, next to Ray's internal text. A redirect
(FastAPI answers a trailing slash with a 307) carries the in-cluster Serve address in
`location`. So no upstream text reaches the caller: each status maps to a message of ours.

The same holds for an error the upstream sends as an event inside a 200 stream (vLLM's
`create_streaming_error_response`, Ray's wrapper around it: `data: {"error": {...}}` after the
status line went out): `stream_error_event` replaces it with ours, keeping only its status.

One message is worth keeping, and is rebuilt from its numbers alone: vLLM's context-length
refusal ("... maximum context length is N tokens ..."), which tells the caller what to change.
The model's context length is no secret (the model card's max_request_context_length).
"""

from __future__ import annotations

import json
import re
from typing import Any

from serving.gateway.protocol import errors

_CONTEXT_LENGTH = re.compile(rb"maximum context length is (\d{1,9}) tokens")


def rewritten(status: int, body: bytes) -> errors.Refusal:
    """Our answer for an upstream response with `status` >= 300 and (the start of) its `body`."""
    if 300 <= status < 400:
        return errors.upstream_failed()  # no route of ours redirects: a mismatch, not the caller's doing
    if status in (400, 422):
        context = _CONTEXT_LENGTH.search(body)
        if context is not None:
            return errors.refusal(
                400,
                f"This model's maximum context length is {int(context.group(1))} tokens, and the prompt plus "
                "the requested output exceed it. Shorten the prompt or lower max_tokens.",
                errors.INVALID_REQUEST,
                code="context_length_exceeded",
                param="messages",
            )
        return errors.refusal(
            400,
            "The model servers refused the request's parameters. Check them against the OpenAI API reference.",
            errors.INVALID_REQUEST,
            code="invalid_request",
        )
    if status == 404:
        return errors.refusal(
            404,
            "The model does not exist or is not being served right now.",
            errors.INVALID_REQUEST,
            code="model_not_found",
            param="model",
        )
    if status == 408:
        return errors.upstream_timeout()
    if status == 413:
        return errors.refusal(
            413,
            "The request is larger than the model servers accept.",
            errors.INVALID_REQUEST,
            code="request_too_large",
        )
    if status in (429, 503):  # Ray Serve sheds load (max_queued_requests) with 503: the platform is busy, not the key
        return errors.refusal(
            503,
            "The model servers are at capacity. Please retry shortly.",
            errors.SERVER_ERROR,
            code="upstream_overloaded",
            headers={"Retry-After": "1"},
        )
    if status == 504:
        return errors.upstream_timeout()
    if 400 <= status < 500 and status not in (401, 403, 407):
        return errors.refusal(
            status,
            f"The model servers refused the request (HTTP {status}).",
            errors.INVALID_REQUEST,
            code="upstream_refused",
        )
    # 5xx, and auth failures the upstream should never answer (the caller's key is not the problem)
    return errors.refusal(
        502 if status < 500 else status,
        "The model servers failed while handling the request. Please retry.",
        errors.SERVER_ERROR,
        code="upstream_error",
    )


def is_error_event(chunk: dict[str, Any]) -> bool:
    """A streamed JSON event that is an error, not a chunk: an `error` object (vLLM, Ray), or an
    `object: error` body (the older OpenAI-style error some servers stream)."""
    return isinstance(chunk.get("error"), dict) or chunk.get("object") == "error"


def stream_error_event(chunk: dict[str, Any], data: bytes) -> bytes:
    """Our SSE `data:` line (without its blank-line end) for an upstream error event `chunk`
    (whose raw JSON is `data`): the same rewrite as a non-2xx body, by the status it names, or
    500 when it names none. The status goes in the error too: the status line said 200."""
    inner = chunk.get("error")
    error: dict[str, Any] = inner if isinstance(inner, dict) else chunk
    code = error.get("code")
    status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code <= 599 else 500
    refusal = rewritten(status, data)
    document = refusal.document()
    document["error"]["status"] = refusal.status
    return b"data: " + json.dumps(document).encode()
