"""LoRA adapters through the real gateway (HTTP, redis-server, the official openai client) in front
of a recording upstream: who may use and see `<base>:<adapter>`, and every other spelling of the
model field refused exactly like an unknown model, with nothing sent upstream. What the gateway
checked is what the upstream got: the name as written, on the base's own route."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime

import httpx
import openai
import pytest
import redis

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.limits.tenants import TenantStore
from serving.gateway.limits.usage_ledger import usage_key
from tests.support.gateway import GENEROUS, USAGE, Answer, Seen, default_answer, raw_request
from tests.support.servers import HANG_BOUND_S

ADAPTERS = {"tiny": ["sql", "pirate"], "other": ["sql"]}
ROUTES = {"tiny": "/tiny", "other": "/other"}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def gateway(start_gateway) -> Iterator[str]:
    with start_gateway(model_adapters=ADAPTERS, model_routes=ROUTES) as (api, _):
        yield api


def new_key(redis_server, tenant: str, **fields) -> str:
    return create_key_sync(redis_server.url, tenant, "test", limits=GENEROUS, **fields)


def key_id(key: str) -> str:
    return key.removeprefix("sk-llm-").split("_", 1)[0]


def llm(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)


def grant_tenant(redis_server, tenant: str, grants: list[str] | None) -> None:
    async def write() -> None:
        store = TenantStore(redis_server.url)
        try:
            await store.set_adapters(tenant, grants)
        finally:
            await store.aclose()

    asyncio.run(write())


def refusal(client: openai.OpenAI, model: object) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)  # type: ignore[arg-type]
    return caught.value


def test_a_granted_adapter_goes_to_its_bases_application_as_written(gateway, redis_server, recorded) -> None:
    client = llm(gateway, new_key(redis_server, "lora-a", allowed_adapters=["tiny:sql"]))
    client.chat.completions.create(model="tiny:sql", messages=MESSAGES, max_tokens=4)
    client.completions.create(model="tiny:sql", prompt="hi", max_tokens=4)
    chat, completion = recorded.seen
    assert chat.raw_path == b"/tiny/v1/chat/completions"
    assert completion.raw_path == b"/tiny/v1/completions"
    assert json.loads(chat.body)["model"] == "tiny:sql" and json.loads(completion.body)["model"] == "tiny:sql"


# Every spelling a lax parser might take for an adapter, or for a granted one: each must be answered
# as `nonexistent` is, and none may reach the upstream (Ray would load whatever follows the first ':').
SPELLINGS = [
    "tiny:pirate",  # served, not granted
    "tiny:nope",  # not served
    "other:sql",  # the granted adapter id under another base
    "TINY:sql",
    "tiny:SQL",
    "Tiny:sql",
    " tiny:sql",
    "tiny:sql ",
    "tiny:sql\n",
    "tiny:sql\t",
    "tiny:sql\x00",
    "tiny\u200b:sql",  # zero-width space
    "t\u0456ny:sql",  # Cyrillic i
    "tiny\uff1asql",  # fullwidth colon
    "tiny\u2236sql",  # ratio sign
    "tiny:s\u0071l\u0301",  # combining accent
    "tiny:sql:x",
    "tiny:sql:",
    "tiny::sql",
    ":sql",
    "tiny:",
    "tiny:*",
    "tiny:s?l",
    "tiny:[s]ql",
    "*:sql",
    "*",
    "tiny:../sql",
    "tiny:sql/../pirate",
    "tiny:%73ql",
    "tiny:sql#",
    "tiny/sql",
]


def test_every_other_spelling_is_refused_like_an_unknown_model(gateway, redis_server, recorded) -> None:
    client = llm(gateway, new_key(redis_server, "lora-b", allowed_adapters=["tiny:sql"]))
    unknown = refusal(client, "nonexistent")
    assert unknown.status_code == 404
    expected = unknown.response.json()

    def same_as_unknown(name: str) -> dict:
        return json.loads(json.dumps(expected).replace(json.dumps("nonexistent")[1:-1], name))

    for name in SPELLINGS:
        refused = refusal(client, name)
        assert refused.status_code == 404, name
        body = refused.response.json()
        assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model", name
        assert body["error"]["message"] == expected["error"]["message"].replace("'nonexistent'", repr(name[:200]))
        assert set(refused.response.headers) == set(unknown.response.headers), name
    assert recorded.seen == []
    assert same_as_unknown("x")["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("model", [["tiny:sql"], {"id": "tiny:sql"}, 1, True, 1.5])
def test_a_model_that_is_not_a_string_is_refused_before_any_lookup(gateway, redis_server, recorded, model) -> None:
    refused = refusal(llm(gateway, new_key(redis_server, "lora-b", allowed_adapters=["*:*"])), model)
    assert refused.status_code == 400
    assert recorded.seen == []


def test_repeated_and_escaped_model_keys_are_parsed_once(gateway, redis_server, recorded) -> None:
    key = new_key(redis_server, "lora-b", allowed_adapters=["tiny:sql"])
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    twice = b'{"model":"tiny:pirate","model":"tiny:sql","messages":[{"role":"user","content":"hi"}]}'
    status, _, _ = raw_request(gateway, "POST", "/v1/chat/completions", headers=headers, body=twice)
    assert status == 400
    escaped_other = b'{"model":"tiny\\u003apirate","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    status, _, _ = raw_request(gateway, "POST", "/v1/chat/completions", headers=headers, body=escaped_other)
    assert status == 404
    assert recorded.seen == []
    escaped_granted = b'{"model":"tiny\\u003asql","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    status, _, _ = raw_request(gateway, "POST", "/v1/chat/completions", headers=headers, body=escaped_granted)
    assert status == 200
    (seen,) = recorded.seen
    assert seen.raw_path == b"/tiny/v1/chat/completions" and json.loads(seen.body)["model"] == "tiny:sql"


def with_ray_adapter_cards(seen: Seen) -> Answer:
    """Ray Serve LLM's list: base cards, and a card per adapter in the bucket, bucket URI and all."""
    if not seen.raw_path.startswith(b"/v1/models"):
        return default_answer(seen)
    cards = [{"id": m, "object": "model", "owned_by": "org", "permission": [], "metadata": {}} for m in ADAPTERS]
    cards += [
        {"id": f"{base}:{a}", "object": "model", "owned_by": "org", "metadata": {"bucket_uri": f"s3://b/{a}"}}
        for base, adapters in ADAPTERS.items()
        for a in adapters
    ]
    body = json.dumps({"object": "list", "data": cards}).encode()
    return Answer(200, (("content-type", "application/json"),), body)


def listed(gateway: str, key: str) -> dict[str, dict]:
    return {card.id: card.model_dump() for card in llm(gateway, key).models.list()}


def test_the_model_list_shows_bases_and_exactly_the_granted_adapters(gateway, redis_server, recorded) -> None:
    recorded.answer = with_ray_adapter_cards
    everything = listed(gateway, new_key(redis_server, "lora-a", allowed_adapters=["tiny:*"]))
    assert set(everything) == {"tiny", "other", "tiny:sql", "tiny:pirate"}
    card = everything["tiny:sql"]
    assert {k: v for k, v in card.items() if v is not None} == {
        "id": "tiny:sql",
        "object": "model",
        "created": 0,
        "owned_by": "org",
        "parent": "tiny",
    }
    assert "bucket_uri" not in json.dumps(everything)
    assert set(listed(gateway, new_key(redis_server, "lora-b"))) == {"tiny", "other"}
    narrow = new_key(redis_server, "lora-b", allowed_adapters=["*:sql"], allowed_models=["other"])
    assert set(listed(gateway, narrow)) == {"other", "other:sql"}


def test_a_tenants_grants_apply_to_keys_without_their_own_and_changes_hold_at_once(
    gateway, redis_server, recorded
) -> None:
    grant_tenant(redis_server, "lora-t", ["tiny:pirate"])
    inherits = llm(gateway, new_key(redis_server, "lora-t"))
    opted_out = llm(gateway, new_key(redis_server, "lora-t", allowed_adapters=[]))
    inherits.chat.completions.create(model="tiny:pirate", messages=MESSAGES, max_tokens=4)
    assert refusal(inherits, "tiny:sql").status_code == 404
    assert refusal(opted_out, "tiny:pirate").status_code == 404
    grant_tenant(redis_server, "lora-t", None)
    assert refusal(inherits, "tiny:pirate").status_code == 404
    assert [json.loads(s.body)["model"] for s in recorded.seen] == ["tiny:pirate"]


def test_usage_lands_on_the_adapter_in_the_ledger(gateway, redis_server, recorded) -> None:
    key = new_key(redis_server, "lora-ledger", allowed_adapters=["tiny:sql"])
    client = llm(gateway, key)
    client.chat.completions.create(model="tiny:sql", messages=MESSAGES, max_tokens=4)
    client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    ledger = redis.Redis.from_url(redis_server.url, decode_responses=True).hgetall(
        usage_key("lora-ledger", datetime.now(UTC).date())
    )
    me = key_id(key)
    assert ledger[f"{me}|completion|tiny:sql"] == str(USAGE["completion_tokens"])
    assert ledger[f"{me}|requests|tiny:sql"] == "1"
    assert ledger[f"{me}|requests|tiny"] == "1"


def test_the_queue_keys_on_the_base_and_the_metrics_on_the_adapter(start_gateway, redis_server, recorded) -> None:
    queues = {"tiny": {"max_ongoing_requests": 4, "max_replicas": 1}}
    with start_gateway(model_adapters=ADAPTERS, model_routes=ROUTES, model_queues=queues) as (api, metrics):
        client = llm(api, new_key(redis_server, "lora-queue", allowed_adapters=["tiny:sql"]))
        client.chat.completions.create(model="tiny:sql", messages=MESSAGES, max_tokens=4)
        exposed = httpx.get(f"{metrics}/metrics", timeout=HANG_BOUND_S).text
    assert 'llmstack_gateway_queue_admitted_total{model="tiny",tenant="lora-queue"} 1.0' in exposed
    assert 'llmstack_gateway_requests_total{model="tiny:sql",status="200",tenant="lora-queue"} 1.0' in exposed
    assert not [
        line for line in exposed.splitlines() if line.startswith("llmstack_gateway_queue") and "tiny:sql" in line
    ]
