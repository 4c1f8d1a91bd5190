"""Key records under concurrent changes, and the outage key cache's lifetime.

Real redis-server; the outage tests run the real gateway under uvicorn and stop its Redis.
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import redis

from ops.devstack.local_redis import start_redis
from serving.gateway.auth.key_format import hash_key
from serving.gateway.auth.keys import MemoryKeyStore, RecentlyVerifiedKeys, RedisKeyStore, create_key_sync
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import running_gateway


def race(store_factory) -> list:
    """Many `set`-style updates of one key at once, with one revocation among them; the
    records each round ends with."""

    async def rounds() -> list:
        store = store_factory()
        finals = []
        try:
            for _ in range(5):
                _, record = await store.create("acme", "raced")
                changes = [store.update(record.key_id, requests_per_minute=i + 1) for i in range(15)]
                await asyncio.gather(*changes[:7], store.revoke(record.key_id), *changes[7:])
                finals.append(await store.get(record.key_id))
        finally:
            await store.aclose()
        return finals

    return asyncio.run(rounds())


def test_a_limit_change_racing_a_revocation_never_undoes_it(redis_server):
    """`llmctl keys set` and `revoke` used to read, change and write back the whole record: a
    set that read the record before the revocation wrote it back unrevoked."""
    for record in race(lambda: RedisKeyStore(redis_server.url)):
        assert record.revoked, record
        assert record.requests_per_minute is not None  # and the limit changes applied too


def test_the_memory_store_updates_atomically_too():
    assert all(record.revoked for record in race(MemoryKeyStore))


def test_recently_verified_keys_expire(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("serving.gateway.auth.keys.time.monotonic", lambda: now[0])
    cache = RecentlyVerifiedKeys(ttl_s=60)
    key, record = asyncio.run(MemoryKeyStore().create("acme", "cached"))
    cache.remember(key, record)
    now[0] += 59.9
    assert cache.recall(key) == record
    now[0] += 0.2
    assert cache.recall(key) is None
    never = RecentlyVerifiedKeys(ttl_s=0)
    never.remember(key, record)
    assert never.recall(key) is None


@pytest.mark.parametrize(
    ("ttl_s", "outage_s", "status"),
    [
        (3600, 0, 200),  # within the TTL, however slow the machine
        (1, 1.2, 503),  # past it
        (0, 0, 503),  # a TTL of 0 remembers nothing
    ],
)
def test_the_outage_key_cache_forgets_keys_after_its_ttl(upstream, ttl_s, outage_s, status):
    """While Redis is down, a key verified within key_cache_ttl_s still works; after that (and
    at once with 0) it gets 503, so a key revoked during an outage stops working."""
    own = start_redis()
    try:
        key = create_key_sync(own.url, "acme", "cached")
        auth = {"Authorization": f"Bearer {key}"}
        with running_gateway(upstream.url, own.url, key_cache_ttl_s=ttl_s) as gw:
            assert httpx.get(f"{gw}/v1/models", headers=auth, timeout=HANG_BOUND_S).status_code == 200
            verified_at = time.monotonic()
            own.stop()
            time.sleep(max(0.0, verified_at + outage_s - time.monotonic()))
            during = httpx.get(f"{gw}/v1/models", headers=auth, timeout=HANG_BOUND_S)
            assert during.status_code == status
            if status == 503:
                assert during.json()["error"]["code"] == "key_store_unavailable"
                assert during.headers["retry-after"] == "1"
    finally:
        own.stop()


def test_key_format_and_storage_is_hash_only(redis_server, api_key):
    assert re.fullmatch(r"sk-llm-[A-Za-z0-9]{10}_[A-Za-z0-9_-]{43}", api_key)
    stored = redis.Redis.from_url(redis_server.url, decode_responses=True)
    names = list(stored.scan_iter("*"))
    assert f"llmstack:{{key:{hash_key(api_key)}}}" in names
    secret = api_key.split("_", 1)[1]
    for name in names:
        assert secret not in name and secret not in (stored.get(name) or "")
    stored.close()


@pytest.mark.parametrize("store_kind", ["redis", "memory"])
def test_store_verify_revoke_expire_list(redis_server, store_kind):
    async def scenario():
        store = RedisKeyStore(redis_server.url) if store_kind == "redis" else MemoryKeyStore()
        try:
            key, record = await store.create("acme", "lifecycle")
            assert (await store.verify(key)) == record
            assert await store.verify(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
            assert await store.verify("not-a-key") is None
            past = datetime.now(timezone.utc) - timedelta(minutes=1)
            expired, _ = await store.create("acme", "old", expires_at=past)
            assert await store.verify(expired) is None
            assert await store.revoke(record.key_id) and not await store.revoke("nosuchkey0")
            assert await store.verify(key) is None
            listed = {r.key_id: r for r in await store.list()}
            assert listed[record.key_id].revoked
        finally:
            await store.aclose()

    asyncio.run(scenario())


def test_create_key_sync_refuses_the_in_memory_store():
    with pytest.raises(ValueError, match="LLMSTACK_REDIS_URL"):
        create_key_sync(None, "acme", "x")
