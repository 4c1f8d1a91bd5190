"""One tenant tries to fill the gateway's Redis with batch uploads and creates, on a real
redis-server at a small maxmemory. Another tenant's state (daily counters, monthly spend, usage
ledger, file record) must survive byte for byte, and that tenant, whose monthly budget is spent,
must still be refused.

- Under `volatile-lru` (ElastiCache's default, which evicts keys with a TTL: exactly those
  counters), the gateway's own bounds must keep the attacker from filling Redis at all: line
  bodies in storage, caps on active batches and on the Redis bytes their lines hold.
- Under `noeviction` (what the stack runs), an attacker that does fill it (here: a Redis far
  smaller than the caps assume) makes Redis refuse writes, and admission must then refuse
  every request (503) rather than fall back to per-replica limits that forget budgets.

Each test starts its own redis-server and gateway: under 10 s each (seven creates each check a
4.5 MB file; the fill of the small Redis ~2 s).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from decimal import Decimal

import httpx
import openai
import pytest
import redis

from ops.devstack.local_redis import running_redis
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.batch.store import file_key
from serving.gateway.limits.tenants import TenantStore
from serving.gateway.limits.usage_ledger import tenant_tag
from tests.support.gateway import GENEROUS, gateway_settings, serving_gateway
from tests.support.servers import HANG_BOUND_S

VICTIM, ATTACKER, BYSTANDER = "victim-co", "attacker-co", "bystander-co"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, content: str = "hi") -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 4},
    }


def client(api: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)


def chat_status(api: str, key: str) -> tuple[int, str | None]:
    response = httpx.post(
        f"{api}/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}, timeout=HANG_BOUND_S
    )
    code = response.json().get("error", {}).get("code") if response.status_code != 200 else None
    return response.status_code, code


def victim_state(plain: redis.Redis, file_id: str) -> dict[bytes, bytes | None]:
    """The victim tenant's budget state in Redis (daily counters, spend, ledger, limits) and its
    file record, dumped. Not its rate state (request and token TATs, slots): that expires by design."""
    pattern = tenant_tag(VICTIM).replace("{", "\\{").replace("}", "\\}") + "*"
    names = [
        *(n for n in plain.scan_iter(match=pattern) if not n.endswith((b":rpm", b":tpm", b":slots"))),
        file_key(file_id).encode(),
    ]
    return {name: plain.dump(name) for name in names}


@pytest.fixture
def gateway_on(tmp_path, recorded) -> Iterator:
    """`with gateway_on(redis_url, workers=n) as (api, metrics):` a gateway with the Batch API,
    its model priced (budgets in dollars)."""

    def start(redis_url: str, workers: int):
        return serving_gateway(
            gateway_settings(
                recorded.url,
                redis_url,
                batch_storage_url=f"file://{tmp_path}",
                max_body_bytes=256_000,
                batch={"sweep_interval_s": 0.1, "workers": workers, "lease_s": 2},
                model_usd_per_million_tokens={"tiny": Decimal("10000")},
            )
        )  # 8 tokens: $0.08

    yield start


def spend_the_victims_budget(redis_url: str, api: str) -> tuple[str, str]:
    """The victim uses the gateway (a request, an upload), then its monthly budget is lowered
    below what it spent: (its key, its file's id)."""
    key = create_key_sync(redis_url, VICTIM, "app", limits=GENEROUS)
    assert chat_status(api, key) == (200, None)  # daily counters, spend, ledger written
    file_id = client(api, key).files.create(file=("v.jsonl", jsonl([line("v")])), purpose="batch").id

    async def lower() -> None:
        store = TenantStore(redis_url)
        try:
            await store.set(VICTIM, {"monthly_budget_usd": Decimal("0.01")})
        finally:
            await store.aclose()

    asyncio.run(lower())
    assert chat_status(api, key) == (429, "monthly_budget_exceeded")
    return key, file_id


def test_under_volatile_lru_one_tenant_cannot_fill_redis(gateway_on, recorded) -> None:
    # As the issue found it (a 48 MB Redis, a 4.5 MB upload, 14 creates), at half the scale. No
    # worker runs the attacker's lines, as on a saturated model: its batches stay queued.
    with (
        running_redis(maxmemory="24mb", policy="volatile-lru") as server,
        gateway_on(server.url, workers=0) as (api, _),
    ):
        plain = redis.Redis.from_url(server.url)
        try:
            victim_key, victim_file = spend_the_victims_budget(server.url, api)
            before = victim_state(plain, victim_file)
            attacker = client(api, create_key_sync(server.url, ATTACKER, "app", limits=GENEROUS))
            content = jsonl([line(f"a{n}", "x" * 200_000) for n in range(23)])
            uploaded = attacker.files.create(file=("a.jsonl", content), purpose="batch")
            accepted, refused = [], []
            for _ in range(7):
                try:
                    accepted.append(
                        attacker.batches.create(
                            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                        ).id
                    )
                except openai.APIStatusError as exc:
                    refused.append(exc.status_code)
            deadline = time.monotonic() + HANG_BOUND_S
            while not all(enqueued(attacker, b) for b in accepted) and time.monotonic() < deadline:
                time.sleep(0.1)
            info = plain.info()
            after = victim_state(plain, victim_file)
            victim_now = chat_status(api, victim_key)
        finally:
            plain.close()
    assert len(content) > 4_400_000 and len(accepted) == 7 and not refused  # the attack ran, within the caps
    assert info["evicted_keys"] == 0 and info["used_memory"] < info["maxmemory"]
    assert after == before and len(before) >= 5  # daily counters (key, tenant), spend, ledger, limits, file
    assert victim_now == (429, "monthly_budget_exceeded")


def enqueued(attacker: openai.OpenAI, batch_id: str) -> bool:
    """The batch's lines are queued (or it is gone: its record evicted)."""
    try:
        return attacker.batches.retrieve(batch_id).status != "validating"
    except openai.APIStatusError:
        return True


def test_a_full_redis_refuses_writes_and_admission_fails_closed(gateway_on) -> None:
    # A Redis far smaller than the caps assume: the attacker fills it within its caps. No worker
    # runs its lines, so none finishes and frees memory.
    long_id = "i" * 120
    with running_redis(maxmemory="4mb") as server, gateway_on(server.url, workers=0) as (api, metrics):
        plain = redis.Redis.from_url(server.url)
        victim_key, victim_file = spend_the_victims_budget(server.url, api)
        bystander_key = create_key_sync(server.url, BYSTANDER, "app", limits=GENEROUS)
        attacker = client(api, create_key_sync(server.url, ATTACKER, "app", limits=GENEROUS))
        before = victim_state(plain, victim_file)
        content = jsonl([line(f"{long_id}{n}") for n in range(2_000)])
        uploaded = attacker.files.create(file=("a.jsonl", content), purpose="batch")
        deadline = time.monotonic() + HANG_BOUND_S
        while (memory := plain.info("memory"))["used_memory"] < 0.9 * memory[
            "maxmemory"
        ] and time.monotonic() < deadline:
            try:
                attacker.batches.create(
                    input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            except openai.APIStatusError:
                pass
            time.sleep(0.2)
        filled = plain.info("memory")
        # Full, Redis hovers at its limit: a large write refused, a small one taken. Below what
        # it holds now, it refuses every write for what follows (nothing frees: no line runs).
        plain.config_set("maxmemory", filled["used_memory"] - 256 * 1024)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            plain.set("llmstack:probe", "x")
        bystander_now, victim_now = chat_status(api, bystander_key), chat_status(api, victim_key)
        counted = httpx.get(f"{metrics}/metrics").text
        after = victim_state(plain, victim_file)
        evicted = plain.info("stats")["evicted_keys"]
        plain.close()
    assert filled["used_memory"] >= 0.9 * filled["maxmemory"] and filled["maxmemory_policy"] == "noeviction"
    assert bystander_now == (503, "limiter_unavailable")  # fails closed: no per-replica limits without budgets
    assert victim_now[0] in (429, 503)  # still refused, whichever comes first
    assert after == before and evicted == 0
    assert 'llmstack_gateway_redis_out_of_memory_total{component="limiter"}' in counted
