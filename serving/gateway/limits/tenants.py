"""Tenants: where a tenant's limiter state and its own limits live in Redis, and the store
`llmctl tenants` uses to read and change those limits.

Every Redis key of one tenant - its limits, its counters and those of each of its API keys -
carries the hash tag `{tenant:<tenant>}`: they sit in one Redis Cluster slot, so one script
can check and charge a key's limits and its tenant's together (all or nothing, one round
trip). The tenant name is percent-encoded in the tag, so no name can end the tag early or
reach another tenant's keys.

    llmstack:{tenant:<t>}:limits          hash: the tenant's own limits (TenantLimits fields)
    llmstack:{tenant:<t>}:adapters        string: JSON list of the LoRA adapters its keys may use
                                          (grants: serving.gateway.auth.adapter_access); absent: none
    llmstack:{tenant:<t>}:spend:<YYYY-MM>  hash: dollars spent this month (serving.gateway.limits.budgets)
    llmstack:{tenant:<t>}:usage:<date>     hash: the usage ledger (serving.gateway.limits.usage_ledger)
    llmstack:{tenant:<t>}:rpm|tpm|slots|daily            the tenant's counters
    llmstack:{tenant:<t>}:key:<key_id>:rpm|tpm|slots|daily  one key's counters
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from decimal import Decimal
from functools import lru_cache
from urllib.parse import unquote

from serving.gateway.config.gateway_policy import TenantLimits
from serving.gateway.limits.usage_ledger import tenant_tag
from serving.gateway.redis.client import GatedRedis


class TenantsUnavailable(RuntimeError):
    """Redis did not answer a read of a tenant's record; admission answers 503."""


_PREFIX = "llmstack:{tenant:"
LIMIT_FIELDS = tuple(TenantLimits.model_fields)


def tenant_limits_key(tenant: str) -> str:
    return f"{tenant_tag(tenant)}:limits"


def tenant_adapters_key(tenant: str) -> str:
    return f"{tenant_tag(tenant)}:adapters"


def parse_grants(raw: str | None) -> list[str] | None:
    """A tenant's stored adapter grants; None when it has none. A value that is not a JSON list
    of strings grants nothing (never more than was written)."""
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return []
    return [g for g in value if isinstance(g, str)] if isinstance(value, list) else []


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

    async def adapters(self, tenant: str) -> list[str] | None:
        """The LoRA adapters the tenant's keys may use (grants), None when it has no list. Read on
        every request that names an adapter with a key of no list of its own, so a change holds
        from the next request."""
        from redis.exceptions import RedisError

        async with self._client.slot() as redis:
            try:
                raw: str | None = await redis.get(tenant_adapters_key(tenant))
            except (RedisError, OSError) as exc:
                raise TenantsUnavailable(f"Redis did not answer: {type(exc).__name__}") from exc
        return parse_grants(raw)

    async def set_adapters(self, tenant: str, grants: Sequence[str] | None) -> list[str] | None:
        """Replace the tenant's adapter grants (None removes the list: no adapters)."""
        name = tenant_adapters_key(tenant)
        if grants is None:
            await self._client.redis.delete(name)
        else:
            await self._client.redis.set(name, json.dumps(list(grants)))
        return await self.adapters(tenant)

    async def used_today(self, tenant: str) -> int:
        """Tokens the tenant's keys were billed today (UTC, by Redis's clock)."""
        seconds, _ = await self._client.redis.time()
        day, used = await self._client.redis.hmget(tenant_daily_key(tenant), ["day", "used"])
        return int(used) if day is not None and int(day) == seconds // 86_400 and used is not None else 0

    async def list(self) -> dict[str, TenantLimits]:
        """Every tenant with limits or adapter grants of its own."""
        found: dict[str, TenantLimits] = {}
        for suffix in ("limits", "adapters"):
            async for name in self._client.redis.scan_iter(match=f"{_PREFIX}*}}:{suffix}", count=500):
                tenant = unquote(name[len(_PREFIX) : name.index("}")])
                found[tenant] = await self.get(tenant)
        return dict(sorted(found.items()))

    async def aclose(self) -> None:
        await self._client.aclose()
