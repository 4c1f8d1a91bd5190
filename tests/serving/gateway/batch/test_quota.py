"""What a batch may take, checked at create: the caps on active batches and on the Redis bytes their
lines hold (per tenant, for the whole gateway), the key's remaining budgets, and the footprint
bound itself against what a real redis-server holds for a batch."""

from __future__ import annotations

import asyncio
import json
import time
from decimal import Decimal

import openai
import pytest
import redis

from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.batch.lines import check_input
from serving.gateway.batch.objects import output_line
from serving.gateway.batch.quota import redis_footprint
from serving.gateway.batch.store import BatchStore, batch_key, work_key
from serving.gateway.limits.tenants import TenantStore
from serving.gateway.redis.client import redis_client
from tests.support.gateway import GENEROUS, gateway_settings
from tests.support.servers import HANG_BOUND_S


def line(custom_id: str, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
    }


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def create(client: openai.OpenAI, lines: list[dict]):
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def refusal(client: openai.OpenAI, lines: list[dict]) -> tuple[int, str | None, str | None, int]:
    """(status, code, x-should-retry, batches the tenant has) of a create that must be refused."""
    with pytest.raises(openai.APIStatusError) as refused:
        create(client, lines)
    body = refused.value.body if isinstance(refused.value.body, dict) else {}
    return (
        refused.value.status_code,
        body.get("code"),
        refused.value.response.headers.get("x-should-retry"),
        len(client.batches.list().data),
    )


@pytest.mark.parametrize("custom_id_length", [1, 40, 512])
def test_the_footprint_bounds_what_a_batch_holds_in_redis(redis_server, custom_id_length) -> None:
    # Its custom ids, one stream entry per line to run, the answers of lines refused up front: as
    # prepare leaves them (runner._prepare), measured with MEMORY USAGE.
    from serving.gateway.config.settings import GatewaySettings

    settings = GatewaySettings(upstream_url="http://upstream:8000", models=["tiny"])
    key = KeyRecord.model_validate(
        {"key_id": "k", "tenant": "quota-co", "name": "k", "created_at": "2026-01-01T00:00:00+00:00"}
    )
    lines = [line(f"a{n}".zfill(custom_id_length)) for n in range(300)]
    lines += [{**line(f"r{n}".zfill(custom_id_length)), "url": "/v1/embeddings"} for n in range(100)]
    checked = check_input(jsonl(lines), "/v1/chat/completions", key, settings)
    assert len(checked.lines) == 300 and len(checked.rejected) == 100 and not checked.problems
    batch_id = f"batch_quota{custom_id_length}"

    async def held() -> int:
        client = redis_client(redis_server.url, decode_responses=True)
        try:
            store = BatchStore(client)
            await store.set_ids(batch_id, checked.custom_ids)
            for rejected in checked.rejected:
                await store.record(
                    batch_id,
                    rejected.custom_id,
                    output_line(rejected.custom_id, rejected.status, None, rejected.body),
                    ok=False,
                )
            at = 0
            refs = []
            for x in checked.lines:
                refs.append({"custom_id": x.custom_id, "at": str(at), "len": str(len(x.body))})
                at += len(x.body)
            await store.enqueue(batch_id, "quota-co", refs)
            names = [batch_key(batch_id, "ids"), batch_key(batch_id, "failed"), work_key(batch_id)]
            total = sum([await client.memory_usage(name, samples=0) for name in names])
            await store.retire(batch_id, "quota-co")
            return total
        finally:
            await client.aclose()

    actual, bound = asyncio.run(held()), redis_footprint(checked)
    assert actual <= bound <= 3 * actual, (actual, bound)  # a bound, and not a loose one


@pytest.fixture(scope="module")
def capped(redis_server, recording_upstream, batch_dir):
    """A gateway with small caps that runs no batch line (no workers: its batches stay active),
    and a new key of a tenant per call."""
    from tests.support.gateway import serving_gateway

    settings = gateway_settings(
        recording_upstream.url,
        redis_server.url,
        batch_storage_url=f"file://{batch_dir}",
        batch={
            "sweep_interval_s": 0.1,
            "workers": 0,
            "lease_s": 2,
            "max_active_batches_per_tenant": 2,
            "max_queued_bytes_per_tenant": 20_000,
            "max_active_batches": 4,
            "max_queued_bytes": 1_000_000,
        },
        model_usd_per_million_tokens={"tiny": Decimal("10000")},
    )
    with serving_gateway(settings) as (api, _):
        yield lambda tenant, **limits: openai.OpenAI(
            base_url=f"{api}/v1",
            api_key=create_key_sync(redis_server.url, tenant, "k", limits={**GENEROUS, **limits}),
            max_retries=0,
            timeout=HANG_BOUND_S,
        )


def test_a_tenant_has_at_most_its_active_batches_and_queued_bytes(capped) -> None:
    client = capped("busy-co")
    first, second = create(client, [line("a")]), create(client, [line("b")])
    assert refusal(client, [line("c")]) == (429, "too_many_active_batches", "false", 2)
    client.batches.cancel(second.id)  # cancelling: still active until it is finalized
    deadline = time.monotonic() + HANG_BOUND_S
    while client.batches.retrieve(second.id).status != "cancelled" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert create(client, [line("d")]).status == "validating"  # an ended batch gives its place back
    assert client.batches.retrieve(first.id).status in ("validating", "in_progress")
    # Lines of 200-character custom ids: 640 Redis bytes each by the bound; 100 of them are past
    # the tenant's 20,000, 20 are not.
    wide = capped("wide-co")
    assert refusal(wide, [line(f"{n:0200d}") for n in range(100)]) == (429, "batch_queue_full", "false", 0)
    assert create(wide, [line(f"{n:0200d}") for n in range(20)]).status == "validating"


def test_the_gateway_has_at_most_its_active_batches(capped) -> None:
    # busy-co holds 2 (the test before) and wide-co 1: room for one more of anyone's.
    late, later = capped("late-co"), capped("later-co")
    create(late, [line("x")])
    status, code, _, count = refusal(later, [line("y")])
    assert (status, code, count) == (503, "batch_capacity_full", 0)


def test_a_batch_that_cannot_complete_within_the_budget_left_is_refused_at_create(capped, redis_server) -> None:
    # A 1-token daily budget: no line can ever run.
    assert refusal(capped("stingy-co", daily_token_budget=1), [line("a")])[:2] == (429, "daily_token_budget_exceeded")
    # Its largest line reserves more than the budget (max_tokens alone): it could never run.
    big = refusal(capped("big-ask-co", daily_token_budget=3000), [line("a"), line("b", max_tokens=3000)])
    assert big[:2] == (429, "daily_token_budget_exceeded")
    # A monthly budget already spent (the tenant's, lowered below what it spent).
    spent = capped("spent-co")
    spent.files.create(file=("in.jsonl", jsonl([line("a")])), purpose="batch")
    assert spent.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])

    async def lower() -> None:
        store = TenantStore(redis_server.url)
        try:
            await store.set("spent-co", {"monthly_budget_usd": Decimal("0.01")})
        finally:
            await store.aclose()

    asyncio.run(lower())
    assert refusal(spent, [line("a")])[:2] == (429, "monthly_budget_exceeded")
    plain = redis.Redis.from_url(redis_server.url)
    try:
        stored = [
            n
            for n in plain.scan_iter(match="llmstack:{batch:*", _type="hash")
            if b"spent-co" in (plain.hget(n, "tenant") or b"")
        ]
    finally:
        plain.close()
    assert stored == []  # refused: nothing of it was kept


def test_keys_of_the_same_tenant_share_its_caps(capped) -> None:
    another_key = capped("busy-co")  # a new key of the tenant that holds 2 active batches
    assert refusal(another_key, [line("z")])[:2] == (429, "too_many_active_batches")
