"""Reading the gateway's usage ledger (`serving.gateway.limits.usage_ledger`) for a report period.

One SCAN per day for that day's hashes of every tenant, then one HGETALL per hash: an admin
read that touches each key once, so it works on Redis Cluster node by node the same way.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterable
from datetime import date

from infra.plan.showback import Usage
from serving.gateway.limits.usage_ledger import DailyUsage, day_pattern, parse_usage_hash, parse_usage_key


async def _read(redis_url: str, days: list[date]) -> list[DailyUsage]:
    import redis.asyncio as redis

    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
    rows: list[DailyUsage] = []
    try:
        for day in days:
            async for name in client.scan_iter(match=day_pattern(day), count=500):
                parsed = parse_usage_key(name)
                if parsed is not None:
                    rows += parse_usage_hash(parsed[0], parsed[1], await client.hgetall(name))
    finally:
        await client.aclose()
    return rows


def read_usage(redis_url: str, days: list[date]) -> list[DailyUsage]:
    """Every ledger row of these UTC days (raises redis' errors when Redis cannot be read)."""
    return asyncio.run(_read(redis_url, days))


def total_usage(rows: Iterable[DailyUsage]) -> list[Usage]:
    """Daily rows summed per tenant, key and model over the period."""
    sums: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    for row in rows:
        total = sums[(row.tenant, row.key_id, row.model)]
        total[0] += row.prompt_tokens
        total[1] += row.completion_tokens
        total[2] += row.requests
        total[3] += row.overhead_prompt_tokens
        total[4] += row.overhead_completion_tokens
    return [
        Usage(
            tenant=t,
            key_id=k,
            model=m,
            prompt_tokens=p,
            completion_tokens=c,
            requests=r,
            overhead_prompt_tokens=op,
            overhead_completion_tokens=oc,
        )
        for (t, k, m), (p, c, r, op, oc) in sorted(sums.items())
    ]
