"""The gateway's probes and access log: readiness and the key cache through a Redis outage, access
lines with the key id and never the key or the prompt, a client that leaves mid-body logged as 499."""

from __future__ import annotations

import json
import logging
import time

import httpx
import openai
import pytest

from ops.devstack.local_redis import start_redis
from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from tests.support.openai_fakes import chat, client, serving_gateway, settings_for
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import key_id_of


@pytest.mark.parametrize("fail_mode", ["closed", "local"])
def test_redis_outage_readyz_and_key_cache(fake_upstream, fail_mode):
    own_redis = start_redis()
    try:
        used, unused = (create_key_sync(own_redis.url, "acme", name) for name in ("used", "unused"))
        settings = settings_for(fake_upstream.url, own_redis.url, limiter_fail_mode=fail_mode)
        with serving_gateway(settings, RedisKeyStore(own_redis.url)) as (gw, admin):
            assert httpx.get(f"{admin}/readyz").json() == {"status": "ready"}
            client(gw, used).models.list()  # verified in Redis: remembered for key_cache_ttl_s
            port = own_redis.port
            own_redis.stop()
            ready = httpx.get(f"{admin}/readyz")
            assert httpx.get(f"{gw}/healthz").json() == {"status": "ok"}  # liveness ignores Redis
            with pytest.raises(openai.InternalServerError) as caught:  # never verified: 503, not 401
                client(gw, unused).models.list()
            assert caught.value.code == "key_store_unavailable"
            if fail_mode == "closed":
                assert ready.status_code == 503 and ready.json()["reason"]
                with pytest.raises(openai.InternalServerError) as refused:  # a cached key, but no limits
                    chat(client(gw, used))
                assert refused.value.status_code == 503 and refused.value.code == "limiter_unavailable"
                assert refused.value.response.headers["retry-after"] == "1"
            else:  # degraded, still in the Service: recently verified keys under local limits
                assert ready.status_code == 200 and ready.json()["status"] == "degraded"
                assert chat(client(gw, used)).choices[0].message.content
                assert "llmstack_gateway_degraded 1.0" in httpx.get(f"{admin}/metrics").text
            own_redis = start_redis(port)  # back (empty, like a failed-over replica): recovery needs no restart
            assert httpx.get(f"{admin}/readyz").json() == {"status": "ready"}
            assert "llmstack_gateway_degraded 0.0" in httpx.get(f"{admin}/metrics").text  # Redis answers again
            with pytest.raises(openai.AuthenticationError):  # the new Redis does not know the key: Redis wins
                client(gw, used).models.list()
    finally:
        own_redis.stop()


def test_access_log_has_key_id_never_key_or_prompt(fake_upstream_gateway, api_key, caplog, monkeypatch):
    # Other tests in this session import vLLM, whose logging dictConfig disables loggers that
    # already exist; the gateway process never imports it, so undo that here.
    access = logging.getLogger("llmstack.gateway.access")
    monkeypatch.setattr(access, "disabled", False)
    monkeypatch.setattr(access, "propagate", True)
    caplog.set_level(logging.INFO, logger="llmstack.gateway.access")
    client(fake_upstream_gateway, api_key).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "secret prompt text"}]
    )
    # The access line is written after the last body byte is sent, so the client can finish
    # first: wait for it (bounded), rather than racing the server thread.
    mine: list[dict] = []
    for _ in range(100):
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "llmstack.gateway.access"]
        mine = [line for line in lines if line["key_id"] == key_id_of(api_key)]
        if mine:
            break
        time.sleep(0.05)
    assert mine and mine[-1]["tenant"] == "acme" and mine[-1]["status"] == 200
    assert mine[-1]["path"] == "/v1/chat/completions" and mine[-1]["latency_ms"] >= 0
    assert api_key not in caplog.text and "secret prompt text" not in caplog.text
    caplog.clear()
    huge = "m" * 3000  # a model name is body data: the log keeps 200 characters of it
    httpx.post(
        f"{fake_upstream_gateway}/v1/chat/completions",
        json={"model": huge, "messages": []},
        headers={"Authorization": f"Bearer {api_key}"},
    )
    for _ in range(100):
        logged = [json.loads(r.getMessage())["model"] for r in caplog.records if r.name == "llmstack.gateway.access"]
        if logged:
            break
        time.sleep(0.05)
    assert logged == ["m" * 200]


def test_client_leaving_while_sending_its_body_is_logged_as_499(fake_upstream_gateway, api_key, caplog):
    import socket

    logging.getLogger("llmstack.gateway.access").disabled = False
    caplog.set_level(logging.INFO, logger="llmstack.gateway.access")
    host, port = fake_upstream_gateway.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:  # promises 1000 bytes, sends 10, leaves
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {api_key}\r\n"
            'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model":'.encode()
        )
        time.sleep(0.2)
    deadline = time.monotonic() + HANG_BOUND_S
    while time.monotonic() < deadline and not any('"status": 499' in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    assert any('"status": 499' in r.getMessage() for r in caplog.records)
    assert not any("Exception in ASGI" in r.getMessage() for r in caplog.records)
