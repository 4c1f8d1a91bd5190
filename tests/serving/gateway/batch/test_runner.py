"""How batch lines run: through the gateway's own admission at the lowest queue tier, billed and
counted like any request of the key's tenant, and stopped when the key that made the batch goes."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from serving.gateway.batch.store import batch_key, tenant_work_key, work_key
from serving.gateway.capacity.engine_priority import SHARE_BANDS
from tests.support.batches import batch_reaching
from tests.support.gateway import GENEROUS, generous_key
from tests.support.servers import HANG_BOUND_S
from tests.support.waiting import eventually


def chat_line(custom_id: str) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    }


def create_batch(client: openai.OpenAI, ids: list[str]):
    content = "".join(json.dumps(chat_line(i)) + "\n" for i in ids).encode()
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def run_batch(client: openai.OpenAI, ids: list[str], until: set[str]):
    return batch_reaching(client, create_batch(client, ids).id, until)


def samples(metrics_url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{metrics_url}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_lines_run_at_the_lowest_tier_billed_to_the_tenant(start_gateway, redis_server, recorded) -> None:
    # engine_priority passes the tier's rank to vLLM: the body the upstream gets shows the tier.
    key = generous_key(redis_server.url, "metered-co", "batch", tier="interactive")
    with start_gateway(queue={"engine_priority": True}) as (api, metrics):
        client = openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        assert client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        # online: the key's own tier (its band within the tier: serving.gateway.capacity.engine_priority)
        assert json.loads(recorded.seen.pop().body)["priority"] // SHARE_BANDS == 0
        done = run_batch(client, [f"m-{n}" for n in range(5)], {"completed"})
        seen = samples(metrics)
    assert done.status == "completed"
    # batch: the third of three tiers
    assert {json.loads(s.body)["priority"] // SHARE_BANDS for s in recorded.seen} == {2}
    assert seen[("llmstack_gateway_batch_lines_total", (("outcome", "queued"), ("tenant", "metered-co")))] == 5
    assert seen[("llmstack_gateway_batch_lines_total", (("outcome", "completed"), ("tenant", "metered-co")))] == 5
    assert (
        seen[("llmstack_gateway_requests_total", (("model", "tiny"), ("status", "200"), ("tenant", "metered-co")))]
        == 5 + 1
    )
    assert (
        seen[("llmstack_gateway_tokens_total", (("kind", "completion"), ("model", "tiny"), ("tenant", "metered-co")))]
        == 6 * 3
    )  # the upstream's usage


def test_revoking_the_key_stops_its_batch(start_gateway, redis_server, recorded) -> None:
    def slow(seen):
        from tests.support.gateway import default_answer

        time.sleep(0.05)
        return default_answer(seen)

    recorded.answer = slow
    key = create_key_sync(redis_server.url, "revoked-co", "batch", limits=GENEROUS)
    with start_gateway() as (api, _):
        client = openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
        ids = [f"r-{n}" for n in range(200)]
        content = "".join(json.dumps(chat_line(i)) + "\n" for i in ids).encode()
        uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + HANG_BOUND_S
        while (client.batches.retrieve(batch.id).request_counts.completed or 0) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)

        async def revoke() -> None:
            store = RedisKeyStore(redis_server.url)
            try:
                record = next(r for r in await store.list() if r.tenant == "revoked-co")
                await store.revoke(record.key_id)
            finally:
                await store.aclose()

        asyncio.run(revoke())
        owner = openai.OpenAI(
            base_url=f"{api}/v1",
            api_key=create_key_sync(redis_server.url, "revoked-co", "reader", limits=GENEROUS),
            max_retries=0,
            timeout=HANG_BOUND_S,
        )
        while (done := owner.batches.retrieve(batch.id)).status != "completed" and time.monotonic() < deadline:
            time.sleep(0.05)
        errors = [json.loads(x) for x in owner.files.content(str(done.error_file_id)).text.splitlines()]
    assert done.status == "completed" and done.request_counts is not None
    assert done.request_counts.completed + done.request_counts.failed == 200 and done.request_counts.failed > 0
    assert {line["error"]["code"] for line in errors} == {"invalid_api_key"}


def test_the_group_forgets_processes_gone_without_lines_and_keeps_their_lines(redis_server, monkeypatch) -> None:
    from serving.gateway.batch import runner as runner_module
    from serving.gateway.batch.runner import BatchRunner
    from serving.gateway.batch.store import ACTIVE, WORK_GROUP, BatchStore, work_key
    from serving.gateway.config.settings import GatewaySettings
    from serving.gateway.redis.client import redis_client
    from serving.gateway.telemetry.metrics import GatewayMetrics

    monkeypatch.setattr(runner_module, "GONE_CONSUMER_MS", -1)  # every idle name counts as gone

    async def go() -> tuple[set[str], tuple | None]:
        client = redis_client(redis_server.url, decode_responses=True)
        try:
            store = BatchStore(client)
            stream = work_key("batch_ghosts")
            await store.enqueue("batch_ghosts", "ghost-co", [{"custom_id": "a", "at": "0", "len": "2"}])
            await client.sadd(ACTIVE, "batch_ghosts")
            await client.xreadgroup(WORK_GROUP, "ghost", {stream: "0"}, count=1)  # joins, takes nothing
            await client.xreadgroup(WORK_GROUP, "holder", {stream: ">"}, count=1)  # dies holding a line
            settings = GatewaySettings(upstream_url="http://upstream:8000", redis_url=redis_server.url)
            runner = BatchRunner(settings, None, store, None, GatewayMetrics([]))  # type: ignore[arg-type]
            await runner._forget_gone_consumers()
            names = {c["name"] for c in await client.xinfo_consumers(stream, WORK_GROUP)}
            taken_over = await store.reclaim("heir", await store.active(), 0)  # past its lease (0 here)
            await store.retire("batch_ghosts", "ghost-co")
            return names, taken_over
        finally:
            await client.aclose()

    names, taken_over = asyncio.run(go())
    assert "ghost" not in names and "holder" in names  # its line still waits to be claimed again
    assert taken_over is not None and taken_over[0] == "batch_ghosts" and taken_over[2]["custom_id"] == "a"


@pytest.mark.parametrize("small_tenant", ["fair-co", "other-co"], ids=["same-tenant", "another-tenant"])
def test_a_small_batch_created_after_a_big_one_runs_alongside_it(
    start_gateway, redis_server, recorded, small_tenant
) -> None:
    # The upstream holds every line until both batches are enqueued, so the big one has the
    # workers and its lines all wait before the small one arrives: first in, first out would
    # finish the big one first.
    from tests.support.gateway import default_answer

    gate = threading.Event()

    def gated(seen):
        if b"/completions" in seen.raw_path:
            gate.wait(HANG_BOUND_S)
        return default_answer(seen)

    recorded.answer = gated
    big_key, small_key = (
        create_key_sync(redis_server.url, tenant, "batch", limits=GENEROUS) for tenant in ("fair-co", small_tenant)
    )
    plain = redis.Redis.from_url(redis_server.url, decode_responses=True)

    def enqueued(batch_id: str) -> bool:
        return eventually(
            lambda: json.loads(plain.hget(batch_key(batch_id), "enqueued") or "false"), f"batch {batch_id} enqueued"
        )

    try:
        with start_gateway(batch={"workers": 2}) as (api, _):
            big_client, small_client = (
                openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
                for key in (big_key, small_key)
            )
            big = create_batch(big_client, [f"big-{n}" for n in range(60)])
            assert enqueued(big.id)
            small = create_batch(small_client, [f"small-{n}" for n in range(3)])
            assert enqueued(small.id)
            gate.set()
            small_done = batch_reaching(small_client, small.id, {"completed", "failed"})
            big_meanwhile = big_client.batches.retrieve(big.id)
            big_done = batch_reaching(big_client, big.id, {"completed", "failed"})
            output = [json.loads(x) for x in big_client.files.content(str(big_done.output_file_id)).text.splitlines()]
            deadline = time.monotonic() + HANG_BOUND_S
            while plain.exists(work_key(big.id), work_key(small.id)) and time.monotonic() < deadline:
                time.sleep(0.05)  # retired just after the final status is set
            left = plain.exists(work_key(big.id), work_key(small.id))
            rotation = plain.zrange(tenant_work_key("fair-co"), 0, -1)
    finally:
        gate.set()
        plain.close()
    assert small_done.status == "completed" and small_done.request_counts is not None
    assert small_done.request_counts.completed == 3
    assert big_meanwhile.status == "in_progress" and big_meanwhile.request_counts is not None
    assert big_meanwhile.request_counts.completed <= 30  # first in, first out: 58 or more
    assert big_done.status == "completed" and sorted(line["custom_id"] for line in output) == sorted(
        f"big-{n}" for n in range(60)
    )
    assert left == 0 and big.id not in rotation  # a retired batch's stream goes, and it leaves the rotation


def test_a_rate_limited_tenant_does_not_hold_the_workers(start_gateway, redis_server, recorded) -> None:
    # A key allowed 6 requests a minute sends a 10-line batch: its upload and create take 2 of
    # its burst of 6, 4 lines run, the 6 others are refused by its rate for ~10 s each. Another
    # tenant's 1-line batch created once the refusals began must run before any of those: a
    # worker that slept on a refused line held one of the 2 workers for each.
    throttled = create_key_sync(
        redis_server.url, "throttled-co", "batch", limits={**GENEROUS, "requests_per_minute": 6}
    )
    reader = create_key_sync(redis_server.url, "throttled-co", "reader", limits=GENEROUS)
    prompt = create_key_sync(redis_server.url, "prompt-co", "batch", limits=GENEROUS)

    def line(custom_id: str) -> dict:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": custom_id}], "max_tokens": 4},
        }

    def batch_of(client: openai.OpenAI, ids: list[str]):
        uploaded = client.files.create(
            file=("in.jsonl", "".join(json.dumps(line(i)) + "\n" for i in ids).encode()), purpose="batch"
        )
        return client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )

    refused = ("llmstack_gateway_rate_limited_total", (("limit", "requests"), ("mode", "enforced")))
    with start_gateway(batch={"workers": 2}) as (api, metrics):
        a_client, a_reader, b_client = (
            openai.OpenAI(base_url=f"{api}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
            for key in (throttled, reader, prompt)
        )
        a = batch_of(a_client, [f"a-{n}" for n in range(10)])
        deadline = time.monotonic() + HANG_BOUND_S
        while samples(metrics).get(refused, 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert samples(metrics).get(refused, 0) >= 1, "no line of A was refused by its rate"
        b = batch_of(b_client, ["b-0"])
        b_done = batch_reaching(b_client, b.id, {"completed", "failed"})
        contents = [json.loads(s.body)["messages"][0]["content"] for s in recorded.seen]
        a_meanwhile = a_reader.batches.retrieve(a.id)
        a_reader.batches.cancel(a.id)
        batch_reaching(a_reader, a.id, {"cancelled"})
    assert b_done.status == "completed"
    a_before_b = [c for c in contents[: contents.index("b-0")] if c.startswith("a-")]
    assert len(a_before_b) <= 4  # A's burst only: none of its refused lines ran before B's line
    assert a_meanwhile.status == "in_progress" and a_meanwhile.request_counts is not None
    assert a_meanwhile.request_counts.completed <= 4  # and A's refused lines wait, not fail
    assert a_meanwhile.request_counts.failed == 0


def test_shutdown_ends_the_sweeper_and_workers_even_when_a_redis_call_swallows_the_cancel(
    redis_server, tmp_path
) -> None:
    # On Python 3.11 redis-py sends each command under asyncio.wait_for, which returns the
    # command's result when the command ends just as the cancel lands (python/cpython#86296):
    # a sweeper busy in Redis loses a good share of the cancels the lifespan's shutdown sends it.
    # It must end all the same, or the shutdown waits for it forever and it outlives the gateway
    # (and the redis-server it polls).
    from serving.gateway.http.app import create_apps
    from tests.support.gateway import gateway_settings
    from tests.support.lifespan import loops_left_after_shutdowns

    settings = gateway_settings(
        "http://127.0.0.1:9",  # no line runs: only the loops' own Redis calls matter
        redis_server.url,
        batch_storage_url=f"file://{tmp_path}",
        batch={"sweep_interval_s": 0.001, "workers": 2},
    )

    make_api = lambda: create_apps(settings, RedisKeyStore(redis_server.url)).api  # noqa: E731
    assert loops_left_after_shutdowns(make_api, {"BatchRunner._forever"}) == []
