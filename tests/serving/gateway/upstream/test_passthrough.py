"""What the gateway passes to the upstream and back: headers (never the client's credentials),
its own request id, streams chunk by chunk, a client's disconnect cancelling the upstream, and
an unreachable upstream. An OpenAI-like fake upstream records what reaches it; no test asserts a
wall-clock duration: ordering is shown with events and one monotonic clock."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from ops.harness.processes import free_port
from serving.gateway.auth.keys import RedisKeyStore
from serving.gateway.http.app import create_app
from serving.gateway.upstream.proxy import FORWARDED_UP, forwardable
from tests.support.openai_fakes import USAGE, WORDS, chat, client, settings_for
from tests.support.servers import HANG_BOUND_S, serving


def test_header_forwarding_rules():
    kept = forwardable(
        [
            ("Authorization", "Bearer k"),
            ("X-API-Key", "k"),
            ("Connection", "keep-alive, accept"),
            ("Accept", "*/*"),
            ("Content-Type", "application/json"),
            ("Host", "gw"),
            ("X-Vllm-Priority", "-100"),
        ],
        FORWARDED_UP,
    )
    assert kept == [("content-type", "application/json")]  # accept: named by Connection, so hop-by-hop


def test_client_credentials_are_not_forwarded(fake_upstream_gateway, fake_upstream, api_key):
    client(fake_upstream_gateway, api_key).models.list()
    httpx.get(f"{fake_upstream_gateway}/v1/models", headers={"X-API-Key": api_key})
    for headers in fake_upstream.seen_headers[-2:]:
        assert "authorization" not in headers and "x-api-key" not in headers
        assert api_key not in json.dumps(headers)
        assert headers["accept-encoding"] == "identity"  # relayed bytes stay plain


def test_request_id_is_always_the_gateways_own_and_forwarded(fake_upstream_gateway, fake_upstream, api_key):
    auth = {"Authorization": f"Bearer {api_key}"}
    given = httpx.get(f"{fake_upstream_gateway}/v1/models", headers={**auth, "x-request-id": "req-42"})
    ours = given.headers["x-request-id"]
    assert ours != "req-42" and ours == fake_upstream.seen_headers[-1]["x-request-id"]  # the caller's stays here
    made = httpx.get(f"{fake_upstream_gateway}/v1/models", headers=auth)
    assert made.headers["x-request-id"] not in ("", ours)
    assert made.headers["x-request-id"] == fake_upstream.seen_headers[-1]["x-request-id"]


def test_stream_arrives_incrementally(fake_upstream_gateway, fake_upstream, api_key):
    fake_upstream.client_has_first_chunk.clear()
    stream = chat(
        client(fake_upstream_gateway, api_key),
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-test-scenario": "gated"},
    )
    first_arrived_at, text, usage = None, "", None
    for piece in stream:
        if first_arrived_at is None:
            first_arrived_at = time.monotonic()
            fake_upstream.client_has_first_chunk.set()
        text += "".join(c.delta.content or "" for c in piece.choices)
        usage = piece.usage or usage
    assert fake_upstream.gate_released_by_client is True  # the upstream held back until we had chunk 1
    assert first_arrived_at < fake_upstream.last_chunk_sent_at
    assert text == "".join(WORDS) and usage.total_tokens == USAGE["total_tokens"]


def test_client_disconnect_cancels_the_upstream_stream(fake_upstream_gateway, fake_upstream, api_key):
    fake_upstream.endless_ended.clear()
    stream = chat(client(fake_upstream_gateway, api_key), stream=True, extra_headers={"x-test-scenario": "endless"})
    next(iter(stream))
    stream.close()
    assert fake_upstream.endless_ended.wait(HANG_BOUND_S), "upstream generator was never closed"
    assert not fake_upstream.endless_finished


def test_upstream_down_is_503_with_retry_after(redis_server, api_key):
    dead_upstream = f"http://127.0.0.1:{free_port()}"
    with serving(create_app(settings_for(dead_upstream, redis_server.url), RedisKeyStore(redis_server.url))) as gw:
        with pytest.raises(openai.InternalServerError) as caught:
            chat(client(gw, api_key))
    assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "1"
    assert caught.value.type == "server_error"
