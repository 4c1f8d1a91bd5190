"""What an API key looks like, how it is hashed, and the record stored for it (pure code).

A key is `sk-llm-<key_id>_<secret>`: `key_id` is 10 random alphanumerics, public, and the only
part that ever appears in logs or admin listings; `secret` is 32 random bytes, urlsafe-base64.
The plaintext is shown once, when the key is made, and never stored: stores keep its hash.
"""

from __future__ import annotations

import hashlib
import secrets
import string
from datetime import datetime
from decimal import Decimal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from serving.gateway.config.queue_policy import TIER_NAME

KEY_PREFIX = "sk-llm-"
KEY_ID_LENGTH = 10
_KEY_ID_ALPHABET = string.ascii_letters + string.digits  # no "_": it separates id from secret
_SECRET_BYTES = 32


class KeyRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    key_id: str = Field(description="Public id of the key; safe to log.")
    tenant: str = Field(description="Who owns the key; limits and usage roll up to it.")
    name: str = Field(description="Human label, e.g. 'ci-bot'.")
    created_at: AwareDatetime = Field(description="When the key was made (UTC).")
    expires_at: AwareDatetime | None = Field(default=None, description="After this, the key is refused.")
    allowed_models: list[str] | None = Field(
        default=None, description="Models this key may call; None means every served model."
    )
    allowed_adapters: list[str] | None = Field(
        default=None,
        description="LoRA adapters this key may use: `<base>:<adapter>` names or fnmatch patterns on them "
        "(serving.gateway.auth.adapter_access). None: its tenant's grants; [] : none.",
    )
    revoked: bool = Field(default=False, description="Revoked keys are refused but kept for audit.")
    shadow: bool = Field(
        default=False,
        description="Shadow mode: requests over a limit are logged and counted as if refused, but served. "
        "For trying new limits on live traffic before enforcing them.",
    )
    # Per-key limit overrides; None means the gateway's `default_limits` (older records have none).
    requests_per_minute: int | None = Field(default=None, ge=1, description="Request rate (GCRA) override.")
    tokens_per_minute: int | None = Field(default=None, ge=1, description="Token rate (GCRA) override.")
    daily_token_budget: int | None = Field(default=None, ge=1, description="Tokens per UTC day override.")
    max_concurrent_requests: int | None = Field(default=None, ge=1, description="In-flight requests override.")
    monthly_budget_usd: Decimal | None = Field(
        default=None,
        gt=0,
        max_digits=12,
        decimal_places=2,
        description="Dollars this key may spend per calendar month (UTC), charged at each model's rate card "
        "(serving.gateway.limits.budgets). None: no budget of its own.",
    )
    # Admission order when a model is saturated (serving.gateway.queue.fair_queue); older records have neither.
    tier: str | None = Field(
        default=None,
        pattern=TIER_NAME,
        description="Queue tier of the stack's gateway.queue.tiers; None (or a tier the stack dropped): its default.",
    )
    weight: float | None = Field(
        default=None,
        gt=0,
        le=1000,
        description="Share of a saturated model relative to other tenants in the same tier; None means 1.",
    )


def new_key() -> tuple[str, str]:
    """A fresh (plaintext key, key_id)."""
    key_id = "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(KEY_ID_LENGTH))
    return f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(_SECRET_BYTES)}", key_id


def hash_key(key: str) -> str:
    # A plain SHA-256 is enough here, unlike for passwords: the key carries 256 random bits,
    # so there is no dictionary to try and a slow KDF would only add latency to every request.
    return hashlib.sha256(key.encode()).hexdigest()


def looks_like_key(presented: str) -> bool:
    """Cheap shape check so junk never costs a Redis round trip."""
    return presented.startswith(KEY_PREFIX) and 40 < len(presented) < 100 and presented.isascii()


def is_usable(record: KeyRecord, now: datetime) -> bool:
    return not record.revoked and (record.expires_at is None or now < record.expires_at)
