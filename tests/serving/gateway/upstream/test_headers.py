"""Client headers stay at the gateway unless allowlisted: vLLM and Ray Serve read some as engine
inputs (request id, data-parallel rank, priority, session affinity, multiplexed model id). The
request id the upstream sees is always the gateway's own; the caller's is logged beside it.
"""

from __future__ import annotations

import json
import logging
import re
import time

import httpx
import pytest

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
HOSTILE = {
    "X-Vllm-Priority": "-1000",
    "X-data-parallel-rank": "0",
    "x-session-id": "victim-session",
    "x-request-id": "another-tenants-request",
    "serve_multiplexed_model_id": "other",
    "X-Forwarded-For": "10.0.0.1",
    "User-Agent": "attacker/1.0",
    "Cookie": "session=1",
    "X-HTTP-Method-Override": "DELETE",
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
}
# What aiohttp adds itself to any request, and what the gateway sets.
TRANSPORT = {"host", "content-length"}
OURS = {"x-request-id", "accept-encoding"}


def test_only_allowlisted_headers_reach_the_upstream(gateway, recorded, key):
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {key}", "Accept": "application/json", **HOSTILE},
    )
    assert response.status_code == 200
    (seen,) = recorded.seen
    assert set(seen.headers) == {"content-type", "accept"} | TRANSPORT | OURS, seen.headers
    assert seen.headers["accept-encoding"] == "identity"
    assert re.fullmatch(r"[0-9a-f]{32}", seen.headers["x-request-id"])
    assert response.headers["x-request-id"] == seen.headers["x-request-id"]  # the caller can quote ours


def test_a_stack_can_forward_more_headers_but_never_credentials():
    from pydantic import ValidationError

    from serving.gateway.config.settings import GatewaySettings

    for header in ("Authorization", "x-request-id", "cookie", "host"):
        with pytest.raises(ValidationError, match="forward_request_headers"):
            GatewaySettings(upstream_url="http://u:1", forward_request_headers=[header])


def test_a_header_the_stack_lists_is_forwarded(start_gateway, recorded, key):
    with start_gateway(forward_request_headers=["traceparent"]) as (gateway, _):
        httpx.post(f"{gateway}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}", **HOSTILE})
    (seen,) = recorded.seen
    assert seen.headers["traceparent"] == HOSTILE["traceparent"] and "x-vllm-priority" not in seen.headers


def test_the_callers_request_id_is_logged_beside_ours(gateway, recorded, key, caplog, monkeypatch):
    access = logging.getLogger("llmstack.gateway.access")
    monkeypatch.setattr(access, "disabled", False)  # vLLM's dictConfig, if imported by another test, disables it
    monkeypatch.setattr(access, "propagate", True)
    caplog.set_level(logging.INFO, logger="llmstack.gateway.access")
    httpx.post(
        f"{gateway}/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {key}", "x-request-id": "client-42"},
    )
    lines: list[dict] = []
    deadline = time.monotonic() + 10  # the line is written after the last byte; bounded wait, nothing timed
    while not lines and time.monotonic() < deadline:
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llmstack.gateway.access"]
        time.sleep(0.02)
    (line,) = lines
    assert line["client_request_id"] == "client-42"
    assert line["request_id"] == recorded.seen[-1].headers["x-request-id"] != "client-42"
