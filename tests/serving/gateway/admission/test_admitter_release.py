"""Admission without HTTP: what a stage took is given back when a later stage fails. A large body
takes the key's concurrency slot before it is read (the slot phase); a client that leaves while
sending it must free that slot, or a key with one slot would stay locked out until it expires.
The limiter is the local one, so its counters can be read directly."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import ClientDisconnect, Request

from serving.gateway.admission.admitter import Admission, Admitter
from serving.gateway.auth.keys import MemoryKeyStore
from serving.gateway.limits.limiter import Limiter
from serving.gateway.telemetry.metrics import GatewayMetrics
from tests.support.gateway import GENEROUS, gateway_settings

SETTINGS = gateway_settings("http://127.0.0.1:1", None, default_limits={**GENEROUS, "max_concurrent_requests": 1})
BODY = json.dumps({"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}).encode()


def request(key: str, messages: list[dict]) -> Request:
    """A POST of undeclared length (so its key's slot is taken before the body is read)."""

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    return Request(
        {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "root_path": "",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "scheme": "http",
            "server": ("127.0.0.1", 80),
            "client": ("127.0.0.1", 5000),
            "headers": [(b"authorization", f"Bearer {key}".encode()), (b"content-type", b"application/json")],
        },
        receive,
    )


def test_a_client_gone_mid_body_gives_its_slot_back():
    async def go() -> tuple[int, bool]:
        store = MemoryKeyStore()
        key, record = await store.create("acme", "uploader")
        limiter = Limiter(None, "local", request_timeout_s=60, on_redis_error=lambda: None)
        admitter = Admitter(SETTINGS, store, limiter, GatewayMetrics(SETTINGS.models))
        with pytest.raises(ClientDisconnect):
            await admitter.admit(request(key, [{"type": "http.request", "body": BODY[:10], "more_body": True}]))
        in_flight = len(limiter._local._keys[record.key_id].slots)
        # The key's one slot is free again: a whole request is admitted (and then settled).
        admission = await admitter.admit(request(key, [{"type": "http.request", "body": BODY, "more_body": False}]))
        admitted = isinstance(admission, Admission)
        if admitted:
            await admission.settle(admission.meter.billed_usage())
        return in_flight, admitted

    assert asyncio.run(go()) == (0, True)
