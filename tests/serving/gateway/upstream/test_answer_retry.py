"""Which failures of a non-streamed request send it once more (serving.gateway.upstream.answer_retry):
a replica lost after the request reached it, never a failed connect (the session retries those)
nor a timeout (the engine may still be working on it), and never twice."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
import pytest

from serving.gateway.upstream.answer_retry import answered


def attempts(*outcomes):
    """A request function answering each call with the next outcome (a status, or an exception)."""
    calls = []

    async def request():
        outcome = outcomes[len(calls)]
        calls.append(outcome)
        if isinstance(outcome, BaseException):
            raise outcome
        return SimpleNamespace(status=outcome, close=lambda: None)

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
        assert run(request) == (first, [])
    assert len(calls) == 1


def test_off_unless_asked():
    request, calls = attempts(502, 200)
    assert run(request, again=False) == (502, [])
    assert len(calls) == 1
