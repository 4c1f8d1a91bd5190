"""Which failures of a non-streamed request send it once more (serving.gateway.upstream.answer_retry):
a replica lost after the request reached it, never a failed connect (the session retries those)
nor a timeout (the engine may still be working on it), and never twice."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from serving.gateway.upstream.answer_retry import answered

# Ray's HAProxy page for its 502/503/504; vLLM's JSON 500; a Serve replica's unhandled-exception 500.
RAY_HAPROXY_PAGE = (500, "text/plain", 21)
VLLM_ERROR = (500, "application/json", 120)
REPLICA_EXCEPTION = (500, "application/octet-stream", 21)


def attempts(*outcomes):
    """A request function answering each call with the next outcome: a status, a (status,
    content type, content length) answer, or an exception."""
    calls = []

    async def request():
        outcome = outcomes[len(calls)]
        calls.append(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        status, content_type, length = outcome if isinstance(outcome, tuple) else (outcome, "application/json", 2)
        return SimpleNamespace(status=status, content_type=content_type, content_length=length, close=lambda: None)

    return request, calls


def run(request, *, again=True):
    reasons = []
    response = asyncio.run(answered(request, again=again, on_retry=reasons.append))
    return response.status, reasons


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        (aiohttp.ServerDisconnectedError(), "connection_reset"),
        (aiohttp.ClientPayloadError("cut"), "connection_reset"),
        (aiohttp.ClientOSError(104, "reset"), "connection_reset"),
        (502, "upstream_unavailable"),
        (503, "upstream_unavailable"),
        (RAY_HAPROXY_PAGE, "upstream_unavailable"),
    ],
)
def test_a_lost_replica_gets_the_request_once_more(first, reason):
    request, calls = attempts(first, 200)
    assert run(request) == (200, [reason])
    assert len(calls) == 2


@pytest.mark.parametrize("second", [aiohttp.ServerDisconnectedError(), 502])
def test_never_more_than_once(second):
    request, calls = attempts(502, second)
    if isinstance(second, BaseException):
        with pytest.raises(type(second)):
            run(request)
    else:
        assert run(request)[0] == 502
    assert len(calls) == 2


@pytest.mark.parametrize(
    "first",
    [
        aiohttp.ClientConnectorError(SimpleNamespace(ssl=None, host="h", port=1), OSError(111, "refused")),
        aiohttp.ServerTimeoutError(),
        500,
        VLLM_ERROR,
        REPLICA_EXCEPTION,
        400,
        504,
    ],
)
def test_other_failures_and_answers_are_not_sent_again(first):
    request, calls = attempts(first, 200)
    if isinstance(first, BaseException):
        with pytest.raises(type(first)):
            run(request)
    else:
        assert run(request) == ((first[0] if isinstance(first, tuple) else first), [])
    assert len(calls) == 1


def test_off_unless_asked():
    request, calls = attempts(502, 200)
    assert run(request, again=False) == (502, [])
    assert len(calls) == 1
