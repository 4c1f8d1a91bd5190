"""API key stores: `RedisKeyStore` for real deployments, `MemoryKeyStore` for one process.

Keys are stored only as hashes (see `serving.gateway.auth.key_format`). Layout, the same in both:

    llmstack:{key:<sha256 hex of the whole key>}  ->  KeyRecord as JSON
    llmstack:keys:by-id:<key_id>                  ->  <sha256 hex>   (for revoke and list)

The `{key:<hash>}` hash tag keeps the record in a Redis Cluster slot of its own. Limiter state
lives under `llmstack:{key:<key_id>}:...` (see serving.gateway.limits.limiter), one slot per key, so
each limiter script touches one slot. Revoked keys keep their record (`revoked: true`) so
listings and audits still see them.

Every change to a record is a compare-and-set (`_replace`: one Lua script in Redis), retried on
a clash, so two operators changing one key at once can never undo each other's change (a
`set` racing a `revoke` cannot bring the key back). The by-id index never changes once
written, so reading it first and then swapping the record touches one key at a time, as
Redis Cluster requires.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from datetime import UTC, datetime
from fnmatch import fnmatchcase

from serving.gateway.auth.key_format import KeyRecord, hash_key, is_usable, looks_like_key, new_key
from serving.gateway.redis.client import GatedRedis, RedisBusy
from serving.gateway.redis.scripts import lua

__all__ = [
    "KeyRecord",
    "KeyStore",
    "KeyStoreUnavailable",
    "MemoryKeyStore",
    "RecentlyVerifiedKeys",
    "RedisKeyStore",
    "create_key_sync",
]

# Each attempt loses only to another writer's completed change, so this many in a row means
# something rewrites the record in a loop; better to say so than to spin.
UPDATE_ATTEMPTS = 100
# Compare-and-set of one string key: swap only if it still holds what the caller read.
REPLACE_LUA = lua("serving.gateway.auth", "replace_key.lua")


class KeyStoreUnavailable(RuntimeError):
    """The store could not answer; admission turns this into a 503, not a 401."""


def _utcnow() -> datetime:
    return datetime.now(UTC)


def _record_key(key_hash: str) -> str:
    return f"llmstack:{{key:{key_hash}}}"


def _id_index_key(key_id: str) -> str:
    return f"llmstack:keys:by-id:{key_id}"


class KeyStore(ABC):
    """Key records over a tiny string key-value interface, so both stores share one layout and
    one implementation of create / verify / revoke / list.

    Lookups go by hash of the presented key, so a wrong key is never compared with a stored
    secret byte by byte: no comparison exists whose timing could leak how much of a guess was
    right, hence no constant-time compare."""

    shared_across_processes: bool = True

    @abstractmethod
    async def _get(self, name: str) -> str | None: ...

    @abstractmethod
    async def _set(self, name: str, value: str, *, only_if_absent: bool = False) -> bool:
        """Store `value`; with `only_if_absent`, False (and nothing stored) when `name` exists."""

    @abstractmethod
    async def _replace(self, name: str, expected: str, value: str) -> bool:
        """Store `value` only if `name` still holds `expected`, atomically; False otherwise."""

    @abstractmethod
    def _names(self, pattern: str) -> AsyncIterator[str]:
        """Names matching a glob `pattern`."""

    @abstractmethod
    async def ping(self) -> None:
        """Raise if the store cannot answer (used by /readyz)."""

    async def aclose(self) -> None:
        return None

    async def create(
        self,
        tenant: str,
        name: str,
        *,
        expires_at: datetime | None = None,
        allowed_models: list[str] | None = None,
        limits: Mapping[str, int] | None = None,
        shadow: bool = False,
        allowed_adapters: list[str] | None = None,
        tier: str | None = None,
        weight: float | None = None,
    ) -> tuple[str, KeyRecord]:
        """Make a key; returns the plaintext (shown once) and its record. `limits` overrides the
        gateway's default limits for this key (requests_per_minute, tokens_per_minute, ...);
        `tier` and `weight` place it in the fair queue (None: the tier's default, weight 1).
        The record is whole at its one write: no request ever sees the key without its tier."""
        while True:
            key, key_id = new_key()
            record = KeyRecord(
                key_id=key_id,
                tenant=tenant,
                name=name,
                created_at=_utcnow(),
                expires_at=expires_at,
                allowed_models=allowed_models,
                allowed_adapters=allowed_adapters,
                shadow=shadow,
                tier=tier,
                weight=weight,
                **(limits or {}),
            )
            # Claim the key_id first, so two creators can never share one; a clash draws again.
            if await self._set(_id_index_key(key_id), hash_key(key), only_if_absent=True):
                await self._set(_record_key(hash_key(key)), record.model_dump_json())
                return key, record

    async def verify(self, presented_key: str) -> KeyRecord | None:
        """The key's record, or None when the key is unknown, revoked or expired."""
        if not looks_like_key(presented_key):
            return None
        record = await self._record(hash_key(presented_key))
        return record if record is not None and is_usable(record, _utcnow()) else None

    async def revoke(self, key_id: str) -> bool:
        """Mark the key revoked (its record stays, for audit); False if there is no such key_id."""
        return await self.update(key_id, revoked=True) is not None

    async def update(self, key_id: str, **changes: object) -> KeyRecord | None:
        """Change fields of a key's record (e.g. shadow=True); None if there is no such key_id.
        Atomic: concurrent updates of one key each apply in full, in some order (module docstring).
        Every replica reads the record on each request, so a change applies on the next one."""
        key_hash = await self._get(_id_index_key(key_id))
        if key_hash is None:
            return None
        name = _record_key(key_hash)
        for _ in range(UPDATE_ATTEMPTS):
            raw = await self._get(name)
            if raw is None:
                return None
            updated = KeyRecord.model_validate({**KeyRecord.model_validate_json(raw).model_dump(), **changes})
            if await self._replace(name, raw, updated.model_dump_json()):
                return updated
        raise RuntimeError(f"key {key_id}: record changed {UPDATE_ATTEMPTS} times while updating it")

    async def get(self, key_id: str) -> KeyRecord | None:
        """The record of a key by its public id (revoked and expired ones too)."""
        key_hash = await self._get(_id_index_key(key_id))
        return None if key_hash is None else await self._record(key_hash)

    async def list(self) -> list[KeyRecord]:
        """Every key, oldest first. An admin operation: one read per key is fine (and, unlike a
        multi-key read, works across Redis Cluster slots)."""
        records = []
        async for index_name in self._names(_id_index_key("*")):
            key_hash = await self._get(index_name)
            record = None if key_hash is None else await self._record(key_hash)
            if record is not None:
                records.append(record)
        return sorted(records, key=lambda r: r.created_at)

    async def _record(self, key_hash: str) -> KeyRecord | None:
        raw = await self._get(_record_key(key_hash))
        return None if raw is None else KeyRecord.model_validate_json(raw)


class RecentlyVerifiedKeys:
    """Records of keys this process verified lately, used only while the store is unreachable.

    With Redis up, every request is checked in Redis, so a revocation applies on the next
    request. During an outage, a key verified less than `ttl_s` ago keeps working (a key
    revoked during the outage too, for at most `ttl_s`); unknown keys get 503, never 401."""

    def __init__(self, ttl_s: float, max_keys: int = 10_000) -> None:
        self.ttl_s, self.max_keys = ttl_s, max_keys
        self._records: OrderedDict[str, tuple[float, KeyRecord]] = OrderedDict()

    def remember(self, presented_key: str, record: KeyRecord | None) -> None:
        key_hash = hash_key(presented_key)
        self._records.pop(key_hash, None)
        if record is None or self.ttl_s <= 0:
            return  # a key Redis refused is forgotten at once
        self._records[key_hash] = (time.monotonic(), record)
        while len(self._records) > self.max_keys:
            self._records.popitem(last=False)  # oldest first

    def recall(self, presented_key: str) -> KeyRecord | None:
        entry = self._records.get(hash_key(presented_key))
        if entry is None or time.monotonic() - entry[0] > self.ttl_s:
            return None
        return entry[1] if is_usable(entry[1], _utcnow()) else None


class MemoryKeyStore(KeyStore):
    """Keys in this process's memory: for a laptop without redis-server, and tests. Each
    gateway process has its own keys, and they vanish on restart."""

    shared_across_processes = False

    def __init__(self) -> None:
        self._values: dict[str, str] = {}

    async def _get(self, name: str) -> str | None:
        return self._values.get(name)

    async def _set(self, name: str, value: str, *, only_if_absent: bool = False) -> bool:
        if only_if_absent and name in self._values:
            return False
        self._values[name] = value
        return True

    async def _replace(self, name: str, expected: str, value: str) -> bool:
        if self._values.get(name) != expected:  # no await in between: atomic on the event loop
            return False
        self._values[name] = value
        return True

    async def _names(self, pattern: str) -> AsyncIterator[str]:
        for name in [n for n in self._values if fnmatchcase(n, pattern)]:
            yield name

    async def ping(self) -> None:
        return None


class RedisKeyStore(KeyStore):
    """Keys in Redis, shared by every gateway replica (layout in the module docstring).

    Reads that fail become `KeyStoreUnavailable` (the outage path); a full connection pool is
    `RedisBusy`, which is load and never takes the outage path (serving.gateway.redis.client)."""

    def __init__(self, redis_url: str) -> None:
        self._client = GatedRedis(redis_url, decode_responses=True)
        self._replace_script = self._client.redis.register_script(REPLACE_LUA)

    async def _get(self, name: str) -> str | None:
        from redis.exceptions import RedisError

        async with self._client.slot() as redis:
            try:
                value: str | None = await redis.get(name)  # decode_responses: str
                return value
            except (RedisError, OSError) as exc:
                raise KeyStoreUnavailable(f"Redis did not answer: {type(exc).__name__}") from exc

    async def _set(self, name: str, value: str, *, only_if_absent: bool = False) -> bool:
        async with self._client.slot() as redis:
            return bool(await redis.set(name, value, nx=only_if_absent))

    async def _replace(self, name: str, expected: str, value: str) -> bool:
        async with self._client.slot():
            return bool(await self._replace_script(keys=[name], args=[expected, value]))

    async def _names(self, pattern: str) -> AsyncIterator[str]:
        async for name in self._client.redis.scan_iter(match=pattern, count=500):
            yield name

    async def ping(self) -> None:
        try:
            async with self._client.slot() as redis:
                await redis.ping()
        except RedisBusy:
            return  # every connection is busy with requests: Redis answers, this replica is loaded

    async def aclose(self) -> None:
        await self._client.aclose()


def create_key_sync(
    redis_url: str | None,
    tenant: str,
    name: str,
    *,
    expires_at: datetime | None = None,
    allowed_models: list[str] | None = None,
    limits: Mapping[str, int] | None = None,
    allowed_adapters: list[str] | None = None,
    tier: str | None = None,
    weight: float | None = None,
) -> str:
    """Create a key from a script or CLI; returns the plaintext key (print it once)."""
    if not redis_url:
        raise ValueError(
            "cannot create a key without Redis: the in-memory key store lives inside one "
            "gateway process. Set LLMSTACK_REDIS_URL to the Redis the gateway uses."
        )

    async def create() -> str:
        store = RedisKeyStore(redis_url)
        try:
            key, _ = await store.create(
                tenant,
                name,
                expires_at=expires_at,
                allowed_models=allowed_models,
                limits=limits,
                allowed_adapters=allowed_adapters,
                tier=tier,
                weight=weight,
            )
            return key
        finally:
            await store.aclose()

    return asyncio.run(create())
