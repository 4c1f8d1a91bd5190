"""make dev's (and the tests') private redis-server never evicts: full, it refuses writes, as the
stack's Redis does in the cluster (budgets, spend and usage have TTLs an evicting policy picks first)."""

from __future__ import annotations

import redis

from ops.devstack.local_redis import running_redis


def test_the_local_redis_refuses_writes_when_full_instead_of_evicting() -> None:
    with running_redis(maxmemory="2mb") as server:
        client = redis.Redis.from_url(server.url)
        try:
            assert client.info("memory")["maxmemory_policy"] == "noeviction"
            client.set("llmstack:budget", "spent", ex=3600)  # a key an evicting policy would take first
            refused = False
            for n in range(64):
                try:
                    client.set(f"llmstack:filler:{n}", "x" * 100_000)
                except redis.exceptions.OutOfMemoryError:
                    refused = True
                    break
            assert refused and client.get("llmstack:budget") == b"spent"
            assert client.info("stats")["evicted_keys"] == 0
        finally:
            client.close()
