"""A busy Redis pool is load, not an outage (serving.gateway.redis.client).

The attack: with every pooled connection busy, the gateway used to treat Redis as down, and in
fail mode `local` answered from its outage key cache and a fresh per-replica limiter: a new
budget for every key, and keys revoked minutes ago accepted. Real redis-server, paused with
CLIENT PAUSE to hold the gateway's only connection; the real gateway under uvicorn.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import redis

from ops.devstack.local_redis import start_redis
from serving.gateway.auth.keys import create_key_sync
from serving.gateway.redis import client as redis_client
from serving.gateway.redis.client import GatedRedis, RedisBusy
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import running_gateway


def test_a_caller_that_finds_every_connection_taken_gets_redis_busy(monkeypatch):
    monkeypatch.setattr(redis_client, "MAX_CONNECTIONS", 1)
    monkeypatch.setattr(redis_client, "POOL_WAIT_S", 0.05)

    async def go() -> None:
        client = GatedRedis("redis://127.0.0.1:1/0")  # never connected: the permits alone are tested
        async with client.slot():
            with pytest.raises(RedisBusy):
                async with client.slot():
                    pass
        async with client.slot():  # freed again
            pass

    asyncio.run(go())


def test_a_full_pool_is_answered_503_not_with_the_outage_fallbacks(upstream, monkeypatch):
    monkeypatch.setattr(redis_client, "MAX_CONNECTIONS", 1)  # each Redis client of the gateway: one connection
    monkeypatch.setattr(redis_client, "POOL_WAIT_S", 0.3)
    own = start_redis()
    try:
        key = create_key_sync(own.url, "acme", "busy")
        auth = {"Authorization": f"Bearer {key}"}
        with running_gateway(upstream.url, own.url, limiter_fail_mode="local") as gw:
            assert httpx.get(f"{gw}/v1/models", headers=auth, timeout=HANG_BOUND_S).status_code == 200  # cached now
            admin = redis.Redis.from_url(own.url)
            admin.execute_command("CLIENT", "PAUSE", "3000", "ALL")  # Redis up, but holding every command
            holder = threading.Thread(target=lambda: httpx.get(f"{gw}/v1/models", headers=auth, timeout=HANG_BOUND_S))
            holder.start()  # takes the key store's only connection and waits on the paused Redis
            time.sleep(0.5)
            busy = httpx.get(f"{gw}/v1/models", headers=auth, timeout=HANG_BOUND_S)
            holder.join(HANG_BOUND_S)
            admin.close()
            metrics = httpx.get(f"{gw.metrics}/metrics", timeout=HANG_BOUND_S).text
        assert busy.status_code == 503, busy.text
        assert busy.json()["error"]["code"] == "gateway_busy" and busy.headers["retry-after"] == "1"
        # Only the request that held the connection through the pause timed out on Redis (the
        # outage path); the busy one never counted as a Redis failure.
        assert 'llmstack_gateway_redis_errors_total{component="keys"} 1.0' in metrics
    finally:
        own.stop()


def test_commands_packed_by_hiredis_are_byte_for_byte_what_redis_py_would_send():
    from redis.asyncio.connection import Connection, SSLConnection
    from redis.exceptions import DataError

    packed = redis_client.redis_client("redis://127.0.0.1:1/0").connection_pool.make_connection()
    plain = Connection()
    assert type(packed).pack_command is not Connection.pack_command  # hiredis is a gateway dependency
    commands = [
        ("EVALSHA", b"ab" * 20, 2, "llmstack:{tenant:a\u00e9}:rpm", b"k2", 10**18, -3, 1.5, "", b""),
        ("SCRIPT LOAD", "return 1"),
        (b"CLIENT PAUSE", "10"),
        ("SET", "k", bytearray(b"v")),
        ("SET", "k", memoryview(b"v")),
    ]
    for command in commands:
        assert b"".join(packed.pack_command(*command)) == b"".join(plain.pack_command(*command))
    for refused in (None, True, object()):
        with pytest.raises(DataError):
            packed.pack_command("SET", "k", refused)
    tls = redis_client.redis_client("rediss://127.0.0.1:1/0").connection_pool.connection_class
    assert issubclass(tls, SSLConnection)  # the URL still picks TLS


def test_a_script_round_trip_through_the_hiredis_packer():
    own = start_redis()

    async def go() -> list:
        client = GatedRedis(own.url)
        script = client.redis.register_script("return {KEYS[1], ARGV[1], ARGV[2]}")
        async with client.slot():
            reply = await script(keys=["llmstack:{t\u00e9}:x"], args=[10**15, "caf\u00e9"])
        await client.aclose()
        return reply

    try:
        assert asyncio.run(go()) == ["llmstack:{t\u00e9}:x".encode(), b"1000000000000000", "caf\u00e9".encode()]
    finally:
        own.stop()
