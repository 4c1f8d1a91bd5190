"""Tenants: where a tenant's limiter state and its own limits live in Redis, and the store
`llmctl tenants` uses to read and change those limits.

Every Redis key of one tenant - its limits, its counters and those of each of its API keys -
carries the hash tag `{tenant:<tenant>}`: they sit in one Redis Cluster slot, so one script
can check and charge a key's limits and its tenant's together (all or nothing, one round
trip). The tenant name is percent-encoded in the tag, so no name can end the tag early or
reach another tenant's keys.

    llmstack:{tenant:<t>}:limits          hash: the tenant's own limits (TenantLimits fields)
    llmstack:{tenant:<t>}:spend:<YYYY-MM>  hash: dollars spent this month (serving.gateway.limits.budgets)
    llmstack:{tenant:<t>}:usage:<date>     hash: the usage ledger (serving.gateway.limits.usage_ledger)
    llmstack:{tenant:<t>}:rpm|tpm|slots|daily            the tenant's counters
    llmstack:{tenant:<t>}:key:<key_id>:rpm|tpm|slots|daily  one key's counters
"""

from __future__ import annotations

from collections.abc import Mapping
from decimal import Decimal
from functools import lru_cache
from urllib.parse import unquote

from serving.gateway.config.gateway_policy import TenantLimits
from serving.gateway.limits.usage_ledger import tenant_tag
from serving.gateway.redis.client import GatedRedis

_PREFIX = "llmstack:{tenant:"
LIMIT_FIELDS = tuple(TenantLimits.model_fields)


def tenant_limits_key(tenant: str) -> str:
    return f"{tenant_tag(tenant)}:limits"


@lru_cache(maxsize=4096)  # twice per request (admission, settlement), for the same few keys
def counter_keys(tenant: str, key_id: str) -> tuple[str, ...]:
    """The nine Redis keys the limiter scripts take, in their KEYS order: the key's request TAT,
    token TAT, in-flight slots, daily usage; the tenant's four; the tenant's limits."""
    tag = tenant_tag(tenant)
    scope = f"{tag}:key:{key_id}"
    return (
        f"{scope}:rpm",
        f"{scope}:tpm",
        f"{scope}:slots",
        f"{scope}:daily",
        f"{tag}:rpm",
        f"{tag}:tpm",
        f"{tag}:slots",
        f"{tag}:daily",
        f"{tag}:limits",
    )


def key_daily_key(tenant: str, key_id: str) -> str:
    return counter_keys(tenant, key_id)[3]


def tenant_daily_key(tenant: str) -> str:
    return f"{tenant_tag(tenant)}:daily"


class TenantStore:
    """Tenants' own limits in the gateway's Redis (layout in the module docstring)."""

    def __init__(self, redis_url: str) -> None:
        self._client = GatedRedis(redis_url, decode_responses=True)

    async def get(self, tenant: str) -> TenantLimits:
        """The tenant's own limits (None where it has none; the gateway's defaults apply there)."""
        values = await self._client.redis.hmget(tenant_limits_key(tenant), LIMIT_FIELDS)
        return TenantLimits(**{f: v for f, v in zip(LIMIT_FIELDS, values) if v is not None})

    async def set(self, tenant: str, changes: Mapping[str, int | Decimal | None]) -> TenantLimits:
        """Set (a number) or clear (None) some of the tenant's limits in one atomic step; returns
        what is stored afterwards. Every gateway replica applies it from the next request."""
        valid = TenantLimits(**{f: v for f, v in changes.items() if v is not None})  # validate before writing
        name = tenant_limits_key(tenant)
        # Decimal strings (the monthly budget): the admit script reads them with tonumber.
        stored = {f: str(getattr(valid, f)) for f, v in changes.items() if v is not None}
        cleared = [f for f, v in changes.items() if v is None]
        async with self._client.redis.pipeline(transaction=True) as pipe:  # MULTI/EXEC: all or nothing
            if stored:
                pipe.hset(name, mapping=stored)
            if cleared:
                pipe.hdel(name, *cleared)
            await pipe.execute()
        return await self.get(tenant)

    async def used_today(self, tenant: str) -> int:
        """Tokens the tenant's keys were billed today (UTC, by Redis's clock)."""
        seconds, _ = await self._client.redis.time()
        day, used = await self._client.redis.hmget(tenant_daily_key(tenant), ["day", "used"])
        return int(used) if day is not None and int(day) == seconds // 86_400 and used is not None else 0

    async def list(self) -> dict[str, TenantLimits]:
        """Every tenant with limits of its own."""
        found: dict[str, TenantLimits] = {}
        async for name in self._client.redis.scan_iter(match=f"{_PREFIX}*}}:limits", count=500):
            tenant = unquote(name[len(_PREFIX) : name.index("}")])
            found[tenant] = await self.get(tenant)
        return dict(sorted(found.items()))

    async def aclose(self) -> None:
        await self._client.aclose()
