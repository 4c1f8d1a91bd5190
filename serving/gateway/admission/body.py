"""A request body: it arrives within a deadline, and is parsed once and within bounds before
anything decides on it.

`parse_json` returns the document or a `BodyError` (answered 400), never raises: the size is
checked first, then the nesting depth with a scan that does not recurse, so `json.loads`
(which recurses once per level) can never hit Python's recursion limit, and neither can any
later code that walks the document. The body must be UTF-8 and strict JSON: no NaN or
Infinity, no repeated keys. The upstream parses the same bytes again, and Python's json keeps
the last of two repeated keys where other parsers keep the first; refusing them leaves no
way for the gateway and the upstream to read one body two ways.

`request_document` is what admission calls: the document for a route, with OpenAI's fields
only, plus the vLLM extensions the stack allows (serving.gateway.protocol.routes).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.gateway.config.settings import GatewaySettings
from serving.gateway.protocol.routes import BODY_ROUTES

INVALID_JSON = "invalid_json"
TOO_DEEP = "json_too_deep"
TOO_LARGE = "request_too_large"
NOT_AN_OBJECT = "invalid_request_body"
UNKNOWN_PARAMETER = "unknown_parameter"
UNEXPECTED_BODY = "unexpected_body"
INVALID_JSON_MESSAGE = "The request body is not valid JSON (UTF-8 text, RFC 8259: no NaN or Infinity)."

# A JSON string: quote, then anything but quote or backslash, or a backslash and any character.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OBJECTS_AS_ARRAYS = bytes.maketrans(b"{}", b"[]")


@dataclass(frozen=True)
class BodyError:
    """Why a body is refused: a message for the caller, an OpenAI-style code and the parameter
    at fault (None for the body as a whole). Always answered 400 invalid_request_error."""

    message: str
    code: str
    param: str | None = None


class _DuplicateKey(ValueError):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return document


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def nesting_within(body: bytes, max_depth: int) -> bool | None:
    """True when arrays and objects in `body` nest at most `max_depth` deep, False when they
    nest deeper, None when the brackets outside strings do not pair up (not JSON, and not
    safe to hand to a recursive parser either: `[[[[...` unclosed recurses as deep as it is long).

    No recursion and no Python loop per character: one regex cuts the strings out, the
    brackets are kept (objects' as arrays': a parser recurses into both alike, and a mismatch
    stops it), and innermost pairs are removed a pass at a time (bytes.replace, at C speed,
    finds only pairs already adjacent, so each pass peels exactly one level). At most
    `max_depth` passes run. Strings are found as a JSON parser finds them up to the first
    syntax error, and a parser reads nothing past that, so it never nests deeper than this counts."""
    brackets = _STRING.sub(b"", body).translate(_OBJECTS_AS_ARRAYS, _NOT_BRACKETS)
    if brackets.count(b"[") <= max_depth:
        return True  # even unpaired, no parser can nest deeper than the openers there are
    for _ in range(max_depth):
        shorter = brackets.replace(b"[]", b"")
        if not shorter:
            return True
        if len(shorter) == len(brackets):
            return None
        brackets = shorter
    return False


def parse_json(body: bytes, *, max_bytes: int, max_depth: int) -> Any:
    """The JSON document in `body`, or a `BodyError`. Bounded: at most `max_bytes`, at most
    `max_depth` levels of arrays/objects. Returns any JSON value (an object is a dict)."""
    if len(body) > max_bytes:
        return BodyError(f"Request body is larger than this gateway accepts ({max_bytes} bytes).", TOO_LARGE)
    nesting = nesting_within(body, max_depth)
    if nesting is False:
        return BodyError(f"The request body nests arrays and objects more than {max_depth} levels deep.", TOO_DEEP)
    if nesting is None:
        return BodyError(INVALID_JSON_MESSAGE, INVALID_JSON)
    try:
        text = body.decode("utf-8")
        return json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_refuse_constant)
    except _DuplicateKey as exc:
        return BodyError(f"The request body repeats the key {str(exc)[:100]!r}.", INVALID_JSON)
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return BodyError(INVALID_JSON_MESSAGE, INVALID_JSON)


def request_document(body: bytes, path: str, settings: GatewaySettings) -> dict[str, Any] | None | BodyError:
    """The body of a request to the served route `path`, checked: a JSON object with known
    fields for POST routes; None for GET routes, which take no body."""
    fields = BODY_ROUTES.get(path)
    if fields is None:
        if body.strip():
            return BodyError(f"GET {path} takes no request body.", UNEXPECTED_BODY)
        return None
    document = parse_json(body, max_bytes=settings.max_body_bytes, max_depth=settings.max_json_depth)
    if isinstance(document, BodyError):
        return document
    if not isinstance(document, dict):
        return BodyError("The request body must be a JSON object.", NOT_AN_OBJECT)
    allowed = fields | frozenset(settings.allowed_body_extensions)
    unknown = sorted(name for name in document if name not in allowed)
    if unknown:
        name = unknown[0][:100]
        return BodyError(
            f"Unrecognized request argument supplied: {name}. This gateway passes OpenAI's parameters "
            "and only the extensions its stack allows (gateway.allowed_body_extensions).",
            UNKNOWN_PARAMETER,
            param=name,
        )
    return document


class BodyTimeout(Exception):
    """The request body did not arrive whole within the deadline (answered 408)."""


class BodyDeadline:
    """ASGI middleware: a request must arrive whole (headers to last body byte) within
    `timeout_s` of its start, so a slow sender (slowloris) holds a connection and its partial
    body for that long at most. A `receive()` still waiting at the deadline raises
    `BodyTimeout` in the handler reading the body. Once the body is complete, later
    `receive()` calls (a streaming response waiting for the client to leave) are not limited."""

    def __init__(self, app: ASGIApp, timeout_s: float) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = time.monotonic() + self.timeout_s
        body_done = False

        async def receive_within() -> Message:
            nonlocal body_done
            if body_done:
                return await receive()
            with anyio.move_on_after(deadline - time.monotonic()) as timer:
                message = await receive()
            if timer.cancelled_caught:
                raise BodyTimeout
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_within, send)


async def read_body_within(
    request: Request, limit: int, on_chunk: Callable[[bytes, int], None] | None = None
) -> bytes | None:
    """The body, or None as soon as it is known to exceed `limit` bytes. Checks the declared
    Content-Length first, then counts while reading, since chunked bodies declare nothing.
    `on_chunk(chunk, size so far)` sees each chunk before it is kept (it may raise to stop)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        if on_chunk is not None:
            on_chunk(chunk, size)
        parts.append(chunk)
    return b"".join(parts)
