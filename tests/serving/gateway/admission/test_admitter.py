"""Admission does the least work it can: one parse of the body, none for a caller over its
request rate with a large body. Real gateway under uvicorn, real redis-server, an upstream
that answers without parsing anything (so every parse counted is the gateway's).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route

from serving.gateway.auth.keys import create_key_sync
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.vllm_upstream import running_gateway

ANSWER = json.dumps(
    {"id": "x", "object": "chat.completion", "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
).encode()


async def canned(request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


@pytest.fixture(scope="module")
def canned_gateway(redis_server):
    upstream_app = Starlette(routes=[Route("/v1/{path:path}", canned, methods=["POST"])])
    with serving(upstream_app) as upstream, running_gateway(upstream, redis_server.url) as url:
        yield url


def test_the_body_is_parsed_once(canned_gateway, redis_server, monkeypatch):
    key = create_key_sync(redis_server.url, "acme", "parse")
    body = json.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "count me"}]})
    parses = []
    real_loads = json.loads

    def counting_loads(text, *args, **kwargs):
        if text in (body, body.encode()):
            parses.append(1)
        return real_loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", counting_loads)
    answer = httpx.post(
        f"{canned_gateway}/v1/chat/completions",
        content=body,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert answer.status_code == 200 and answer.content == ANSWER
    assert len(parses) == 1


def test_nesting_too_deep_to_parse_is_a_400_not_a_traceback(canned_gateway, redis_server):
    key = create_key_sync(redis_server.url, "acme", "deep")
    deep = b'{"model": "tiny", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    answer = httpx.post(
        f"{canned_gateway}/v1/chat/completions",
        content=deep,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "json_too_deep"


def test_a_key_over_its_request_rate_is_refused_before_its_large_body_is_read(canned_gateway, redis_server):
    key = create_key_sync(redis_server.url, "acme", "spent", limits={"requests_per_minute": 1})
    small = json.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert (
        httpx.post(
            f"{canned_gateway}/v1/chat/completions",
            content=small,
            timeout=HANG_BOUND_S,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        ).status_code
        == 200
    )
    host, port = canned_gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_BOUND_S) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 900000\r\n\r\n".encode()
        )
        answer = sock.recv(4096).decode()  # not one byte of the body sent
    assert answer.startswith("HTTP/1.1 429") and "retry-after" in answer.lower()
