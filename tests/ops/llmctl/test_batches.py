"""`llmctl batches ls|show|cancel` against a real redis-server holding batches the gateway's own
store wrote (serving.gateway.batch.store), as a running gateway would have."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from infra.spec.stack_file import PROJECT_ROOT
from serving.gateway.batch.objects import BatchRecord, new_batch_id
from serving.gateway.batch.store import BatchStore
from serving.gateway.redis.client import redis_client


def llmctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "batches", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=PROJECT_ROOT,
        env=dict(os.environ),
        check=False,
    )


def store_call(url: str, action):
    async def go():
        client = redis_client(url, decode_responses=True)
        try:
            return await action(BatchStore(client))
        finally:
            await client.aclose()

    return asyncio.run(go())


@pytest.fixture(scope="module")
def batches(redis_server) -> dict[str, BatchRecord]:
    made = {}

    async def make(store: BatchStore) -> None:
        for tenant, status in (("acme", "in_progress"), ("acme", "completed"), ("globex", "validating")):
            record = BatchRecord(
                id=new_batch_id(),
                tenant=tenant,
                key_id="k1",
                endpoint="/v1/chat/completions",
                input_file_id="file-0",
                status=status,
                created_at=1_800_000_000,
                expires_at=1_800_086_400,
                seq=await store.next_seq(),
                total=3,
            )
            await store.create(record)
            if status == "completed":
                await store.retire(record.id)
            made[f"{tenant}-{status}"] = record
        await store.record(made["acme-in_progress"].id, "a", {"custom_id": "a"}, ok=True)
        await store.enqueue(
            made["acme-in_progress"].id, "acme", [{"custom_id": c, "at": "0", "len": "2"} for c in "bc"]
        )

    store_call(redis_server.url, make)
    return made


def test_ls_lists_newest_first_by_tenant_or_still_running(redis_server, batches) -> None:
    listed = json.loads(llmctl("ls", "--json", "--redis-url", redis_server.url).stdout)
    assert [b["id"] for b in listed] == [
        batches[k].id for k in ("globex-validating", "acme-completed", "acme-in_progress")
    ]
    assert listed[2]["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
    acme = json.loads(llmctl("ls", "--json", "--tenant", "acme", "--redis-url", redis_server.url).stdout)
    assert {b["tenant"] for b in acme} == {"acme"} and len(acme) == 2
    active = json.loads(llmctl("ls", "--json", "--active", "--redis-url", redis_server.url).stdout)
    assert {b["id"] for b in active} == {batches["acme-in_progress"].id, batches["globex-validating"].id}
    table = llmctl("ls", "--redis-url", redis_server.url)
    assert table.returncode == 0 and batches["acme-in_progress"].id in table.stdout


def test_show_and_cancel(redis_server, batches) -> None:
    running = batches["acme-in_progress"].id
    shown = json.loads(llmctl("show", running, "--redis-url", redis_server.url).stdout)
    assert shown["status"] == "in_progress" and shown["tenant"] == "acme" and shown["lines_running"] == 0
    assert shown["lines_waiting"] == 2
    cancelled = llmctl("cancel", running, "--redis-url", redis_server.url)
    assert cancelled.returncode == 0 and "cancelling" in cancelled.stderr
    assert store_call(redis_server.url, lambda s: s.status(running)) == "cancelling"
    assert llmctl("cancel", running, "--redis-url", redis_server.url).returncode == 0  # again: no error
    finished = llmctl("cancel", batches["acme-completed"].id, "--redis-url", redis_server.url)
    assert finished.returncode == 1 and "completed" in finished.stderr


def test_unknown_and_malformed_ids(redis_server) -> None:
    missing = llmctl("show", new_batch_id(), "--redis-url", redis_server.url)
    assert missing.returncode == 1 and "no batch" in missing.stderr
    assert llmctl("cancel", "batch_../../x", "--redis-url", redis_server.url).returncode == 2
