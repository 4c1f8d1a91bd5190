"""Authentication and admission at the gateway over real HTTP: which keys get in, in OpenAI's
error shapes; models a key may use; body size. A real redis-server and uvicorn servers, the
official openai client, and an OpenAI-like fake upstream (tests.support.openai_fakes)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import httpx
import openai
import pytest

from serving.gateway.admission.admitter import requested_model
from serving.gateway.admission.authenticate import presented_key
from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from tests.support.openai_fakes import WORDS, chat, client
from tests.support.vllm_upstream import key_id_of


def test_chat_and_models_pass_through(fake_upstream_gateway, api_key):
    llm = client(fake_upstream_gateway, api_key)
    assert chat(llm).choices[0].message.content == "".join(WORDS)
    assert {m.id for m in llm.models.list()} == {"tiny", "other"}


def test_wrong_key_is_401_in_openai_shape(fake_upstream_gateway, api_key):
    with pytest.raises(openai.AuthenticationError) as caught:
        chat(client(fake_upstream_gateway, api_key[:-4] + "abcd"))
    assert caught.value.code == "invalid_api_key" and caught.value.type == "invalid_request_error"


def test_missing_key_is_401(fake_upstream_gateway):
    response = httpx.post(f"{fake_upstream_gateway}/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert response.status_code == 401
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert "API key" in error["message"]


def test_other_paths_and_methods_answer_in_openai_shape(fake_upstream_gateway, api_key):
    assert httpx.get(f"{fake_upstream_gateway}/admin").json()["error"]["code"] == "unknown_url"
    refused = httpx.delete(f"{fake_upstream_gateway}/v1/models", headers={"X-API-Key": api_key})
    assert refused.status_code == 405 and refused.json()["error"]["type"] == "invalid_request_error"


def test_x_api_key_header_works(fake_upstream_gateway, api_key):
    response = httpx.get(f"{fake_upstream_gateway}/v1/models", headers={"X-API-Key": api_key})
    assert response.status_code == 200 and response.json()["object"] == "list"


def test_revoked_and_expired_keys_are_401(fake_upstream_gateway, redis_server):
    revoked = create_key_sync(redis_server.url, "acme", "to-revoke")
    chat(client(fake_upstream_gateway, revoked))  # works before
    store = RedisKeyStore(redis_server.url)

    async def revoke() -> bool:
        try:
            return await store.revoke(key_id_of(revoked))
        finally:
            await store.aclose()

    assert asyncio.run(revoke())
    expired = create_key_sync(
        redis_server.url, "acme", "expired", expires_at=datetime.now(timezone.utc) - timedelta(seconds=1)
    )
    for key in (revoked, expired):
        with pytest.raises(openai.AuthenticationError):
            chat(client(fake_upstream_gateway, key))


def test_allowed_models_are_enforced(fake_upstream_gateway, redis_server):
    llm = client(fake_upstream_gateway, create_key_sync(redis_server.url, "acme", "tiny-only", allowed_models=["tiny"]))
    assert chat(llm, "tiny").choices
    with pytest.raises(openai.PermissionDeniedError) as caught:
        chat(llm, "other")
    assert caught.value.status_code == 403 and caught.value.code == "model_not_allowed"
    assert llm.models.list().data  # no model named: not model-scoped


def test_body_too_large_is_413(fake_upstream_gateway, api_key):
    with pytest.raises(openai.APIStatusError) as caught:
        client(fake_upstream_gateway, api_key).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x" * 10_000}]
        )
    assert caught.value.status_code == 413
    chunked = httpx.post(
        f"{fake_upstream_gateway}/v1/chat/completions",
        headers={"Authorization": f"Bearer {api_key}"},
        content=iter([b"{" + b" " * 3000, b" " * 3000 + b"}"]),
    )  # no Content-Length
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_restricted_key_must_name_its_model(fake_upstream_gateway, redis_server):
    key = create_key_sync(redis_server.url, "acme", "restricted", allowed_models=["tiny"])
    nameless = httpx.post(
        f"{fake_upstream_gateway}/v1/chat/completions", headers={"X-API-Key": key}, json={"messages": []}
    )
    assert nameless.status_code == 403 and nameless.json()["error"]["code"] == "model_not_allowed"
    unreadable = httpx.post(
        f"{fake_upstream_gateway}/v1/chat/completions", headers={"X-API-Key": key}, content=b"not json"
    )
    assert unreadable.status_code == 400 and unreadable.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"authorization": "Bearer sk-llm-a"}, "sk-llm-a"),
        ({"authorization": "bearer  sk-llm-a "}, "sk-llm-a"),
        ({"x-api-key": "sk-llm-b"}, "sk-llm-b"),
        ({"authorization": "Basic abc", "x-api-key": "sk-llm-b"}, "sk-llm-b"),
        ({"authorization": "Bearer "}, None),
        ({}, None),
    ],
)
def test_presented_key(headers, expected):
    assert presented_key(headers) == expected


def test_requested_model_reads_only_string_models():
    assert requested_model({"model": "tiny", "messages": []}) == "tiny"
    assert requested_model({"model": 7}) is None
    assert requested_model(None) is None
