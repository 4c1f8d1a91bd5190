"""How full the gateway's Redis is, and whether it would evict: read from `INFO memory`.

Redis holds every budget the gateway enforces (daily counters, monthly spend, the usage ledger,
key records). A Redis that evicts under memory pressure (ElastiCache's default policy is
`volatile-lru`, which picks keys with a TTL: exactly those counters) silently gives a tenant its
budget back. The stack runs it with `maxmemory-policy noeviction`, so a full Redis refuses writes
and admission refuses requests (serving.gateway.limits.limiter) instead; these gauges let the memory
alert fire before that, and say so if a Redis the stack did not configure would evict.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from serving.gateway.redis.client import raise_if_cancel_was_lost
from serving.gateway.telemetry.metrics import GatewayMetrics

log = logging.getLogger("llmstack.gateway.redis")

# The one policy the gateway's Redis may run with, in every mode (make dev's redis-server, the
# in-cluster Redis, ElastiCache's parameter group): refuse writes when full, never delete keys.
REQUIRED_POLICY = "noeviction"
POLL_S = 15.0  # a Prometheus scrape interval: the alert needs no finer reading


@dataclass(frozen=True)
class RedisMemory:
    used_bytes: int
    max_bytes: int  # 0: no maxmemory (the machine's memory is the limit)
    policy: str

    @property
    def evicting(self) -> bool:
        return self.policy != REQUIRED_POLICY


def read_memory(info: dict[str, Any]) -> RedisMemory:
    return RedisMemory(
        int(info.get("used_memory", 0)), int(info.get("maxmemory", 0)), str(info.get("maxmemory_policy", ""))
    )


async def watch_redis_memory(redis: Any, metrics: GatewayMetrics, poll_s: float = POLL_S) -> None:
    """Export Redis's memory until cancelled; warn once when its policy would evict."""
    warned = False
    while True:
        with contextlib.suppress(Exception):  # Redis away: the outage alert says so, not this
            memory = read_memory(await redis.info("memory"))
            metrics.redis_memory_used.set(memory.used_bytes)
            metrics.redis_memory_max.set(memory.max_bytes)
            metrics.redis_evicting.set(1 if memory.evicting else 0)
            if memory.evicting and not warned:
                log.warning(
                    "Redis's maxmemory-policy is %s: when full it deletes keys (budgets, spend, usage) "
                    "instead of refusing writes; set maxmemory-policy noeviction",
                    memory.policy,
                )
                warned = True
        # The INFO call can return (or fail) with the shutdown's cancel eaten (Python 3.11): the
        # watcher would poll on, and the lifespan that waits for it would never end.
        raise_if_cancel_was_lost()
        await asyncio.sleep(poll_s)
