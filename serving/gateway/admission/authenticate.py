"""The authenticate stage: who is calling, before any of the body is read (so an unauthenticated
caller cannot make the gateway read or buffer anything).

A key is presented as `Authorization: Bearer <key>` or `X-API-Key: <key>`. While the key store
is unreachable, a key verified in the last `key_cache_ttl_s` is still accepted
(keys.RecentlyVerifiedKeys). A busy Redis pool is not an outage: 503 + Retry-After.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from starlette.requests import Request

from serving.gateway.admission.batch_caller import BATCH_CALLER, BatchCaller
from serving.gateway.auth.key_format import KeyRecord, is_usable
from serving.gateway.auth.keys import KeyStore, KeyStoreUnavailable, RecentlyVerifiedKeys
from serving.gateway.protocol import errors
from serving.gateway.protocol.errors import Refusal
from serving.gateway.redis.client import RedisBusy
from serving.gateway.telemetry.access_log import note_caller
from serving.gateway.telemetry.metrics import GatewayMetrics


@dataclass(frozen=True)
class Caller:
    """An authenticated caller: its key's record, and whether it came from the outage cache."""

    record: KeyRecord
    from_cache: bool


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key from `Authorization: Bearer <key>`, else from `X-API-Key: <key>`."""
    authorization = headers.get("authorization", "")
    scheme, _, credential = authorization.partition(" ")
    if scheme.lower() == "bearer" and credential.strip():
        return credential.strip()
    return headers.get("x-api-key", "").strip() or None


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Authenticator:
    def __init__(self, key_store: KeyStore, metrics: GatewayMetrics, key_cache_ttl_s: float) -> None:
        self.key_store, self.metrics = key_store, metrics
        self.recent_keys = RecentlyVerifiedKeys(key_cache_ttl_s)

    async def authenticate(self, request: Request) -> Caller | Refusal:
        """The caller, or the 401/503 to answer. A batch line (serving.gateway.batch.runner) names
        its key by id in the ASGI scope instead of presenting it: the key is read again, so a
        revoked or expired key stops its batch."""
        caller = request.scope.get(BATCH_CALLER)
        try:
            if isinstance(caller, BatchCaller):
                try:
                    record = await self.key_store.get(caller.key_id)
                except KeyStoreUnavailable:
                    return errors.key_store_unavailable()
                record = caller.record(record) if record is not None and is_usable(record, _utcnow()) else None
                from_cache = False
            else:
                key = presented_key(request.headers)
                if key is None:
                    return errors.missing_api_key()
                record, from_cache = await self._verify(key)
        except RedisBusy:
            return errors.gateway_busy()
        if record is None:
            return errors.key_store_unavailable() if from_cache else errors.invalid_api_key()
        note_caller(request.scope, record)
        return Caller(record, from_cache)

    async def _verify(self, key: str) -> tuple[KeyRecord | None, bool]:
        """(record, came from the outage cache). A busy pool raises RedisBusy: not an outage."""
        try:
            record = await self.key_store.verify(key)
        except KeyStoreUnavailable:
            self.metrics.redis_errors.labels(component="keys").inc()
            return self.recent_keys.recall(key), True
        self.recent_keys.remember(key, record)
        return record, False
