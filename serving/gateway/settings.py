"""Gateway settings: read once from the environment at start, validated, then immutable.

The Kubernetes Deployment (rendered by `infra/render/gateway.py`) sets three variables:

- `LLMSTACK_UPSTREAM_URL`: Ray Serve's OpenAI ingress. The only place the upstream address
  comes from - never from a request.
- `LLMSTACK_GATEWAY_SETTINGS`: JSON with the non-secret settings (port, limits, models...).
- `LLMSTACK_REDIS_URL`: from a Secret; unset or empty means the embedded in-memory key store.

`LLMSTACK_GATEWAY_HOST` / `LLMSTACK_GATEWAY_PORT` override the bind address (local dev, tests).
The limit fields mirror `infra.spec.KeyLimits` / `Gateway` (this package may not import
`infra`); they are typed here so a bad render fails at start, and enforced by `serving.gateway.limits`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

UPSTREAM_VAR = "LLMSTACK_UPSTREAM_URL"
SETTINGS_VAR = "LLMSTACK_GATEWAY_SETTINGS"
REDIS_VAR = "LLMSTACK_REDIS_URL"
HOST_VAR = "LLMSTACK_GATEWAY_HOST"
PORT_VAR = "LLMSTACK_GATEWAY_PORT"


class SettingsError(ValueError):
    """A bad environment; the message is one line that names the variable to fix."""


class _Strict(BaseModel):
    # Unknown keys are typos or version skew between the renderer and the image: fail loudly.
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeyLimits(_Strict):
    """Default per-key limits; a key's own overrides (KeyRecord) win (see serving.gateway.limits)."""

    requests_per_minute: int = Field(default=60, ge=1, description="Request rate (GCRA).")
    tokens_per_minute: int = Field(default=100_000, ge=1, description="Prompt + output tokens rate.")
    daily_token_budget: int = Field(default=2_000_000, ge=1, description="Tokens per UTC day.")
    max_concurrent_requests: int = Field(default=8, ge=1, description="In-flight requests per key.")


class GatewaySettings(_Strict):
    upstream_url: str = Field(description="Base URL of Ray Serve's OpenAI ingress, e.g. http://host:8000.")
    redis_url: str | None = Field(
        default=None,
        description="Redis for keys and limits. None: in-memory keys and limits, single process only.",
    )
    host: str = Field(default="127.0.0.1", description="Address to bind; 0.0.0.0 in a container.")
    port: int = Field(default=8080, ge=1, le=65535, description="Port to listen on.")
    models: list[str] = Field(default_factory=list, description="Model names the upstream serves.")
    model_context_lengths: dict[str, int] = Field(
        default_factory=dict,
        description="max_model_len per served model: how much output a request without max_tokens can get.",
    )
    model_routes: dict[str, str] = Field(
        default_factory=dict,
        description="Route prefix of each model's own Serve application (direct serving path), e.g. "
                    "{\"tiny-chat\": \"/tiny-chat\"}; models not listed go to `/` (serving.gateway.routes).",
    )
    max_body_bytes: int = Field(default=1_000_000, ge=1, description="Largest request body; larger gets 413.")
    default_limits: KeyLimits = Field(default_factory=KeyLimits, description="Per-key defaults.")
    max_tokens_ceiling: int = Field(
        default=4096, ge=1,
        description="Largest max_tokens accepted (serving.gateway.request_policy); also the output reserved "
                    "when a request sets none.",
    )
    max_n: int = Field(default=4, ge=1, description="Largest n (and best_of) accepted: choices per request.")
    max_top_logprobs: int = Field(
        default=5, ge=0,
        description="Largest top_logprobs (and legacy integer logprobs on /v1/completions) accepted.",
    )
    allow_logit_bias: bool = Field(
        default=False,
        description="Accept a non-empty logit_bias. Off by default: with logprobs it is a model-extraction lever.",
    )
    limiter_fail_mode: Literal["local", "closed"] = Field(
        default="local",
        description="When the limiter's Redis fails: per-replica in-memory limits (local), or 503 (closed)."
    )
    upstream_idle_timeout_s: float = Field(
        default=120.0, gt=0,
        description="Longest silence from the upstream: before its first byte (a long queue) or between two "
                    "chunks of a stream. Past it the request fails (504 before the first byte; cut stream after).",
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0,
        description="Longest a whole request may take, stream included; a stream still running is cut. "
                    "Also bounds how long a crashed gateway's concurrency slot stays taken.",
    )
    key_cache_ttl_s: float = Field(
        default=60.0, ge=0,
        description="While Redis is unreachable, keys verified this recently are still accepted (0: never). "
                    "With Redis up every request is checked there, so revocation is immediate.",
    )
    log_prompts: bool = Field(
        default=False,
        description="Add the request's messages/prompt to its access-log line. Off: prompts are tenants' data.",
    )
    shutdown_grace_s: float = Field(
        default=90.0, ge=0,
        description="After SIGTERM, how long in-flight streams may run. Below the pod's 120 s grace period.",
    )

    @field_validator("upstream_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        value = value.rstrip("/")
        if "/" in value.split("://", 1)[1] or "?" in value:
            # The gateway forwards /v1/... as is: a path here would be silently replaced.
            raise ValueError(f"must be scheme://host[:port] with no path (the gateway appends /v1/...), got {value!r}")
        return value

    @field_validator("model_routes")
    @classmethod
    def _route_prefixes(cls, value: dict[str, str]) -> dict[str, str]:
        for model, prefix in value.items():
            segments = prefix.split("/")
            if not prefix.startswith("/") or any(s in (".", "..") for s in segments) or "?" in prefix or "\\" in prefix:
                raise ValueError(f"route prefix of {model!r} must be a plain absolute path like /my-model, got {prefix!r}")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            # Never echo the value: it may carry the Redis AUTH token.
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value


# Keys that only the dedicated variables may set: secrets and the upstream stay out of the JSON.
_ENV_ONLY = {"upstream_url": UPSTREAM_VAR, "redis_url": REDIS_VAR}


def load_settings(environ: Mapping[str, str] = os.environ) -> GatewaySettings:
    """Build settings from the environment, or raise `SettingsError` naming the bad variable."""
    file_values = _settings_json(environ.get(SETTINGS_VAR, ""))
    values: dict[str, Any] = dict(file_values)
    sources: dict[str, str] = {}  # field -> the variable that set it, for error messages

    def take(var: str, field: str) -> None:
        raw = environ.get(var, "").strip()
        if raw:
            values[field] = raw
            sources[field] = var

    if not environ.get(UPSTREAM_VAR, "").strip():
        raise SettingsError(f"{UPSTREAM_VAR} is not set: give the URL of Ray Serve's OpenAI ingress")
    take(UPSTREAM_VAR, "upstream_url")
    take(REDIS_VAR, "redis_url")
    take(HOST_VAR, "host")
    take(PORT_VAR, "port")
    try:
        return GatewaySettings.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error["loc"])
        field = str(error["loc"][0]) if error["loc"] else ""
        where = sources.get(field) or f"{SETTINGS_VAR} key {path!r}"
        raise SettingsError(f"{where}: {error['msg']}") from None


def _settings_json(raw: str) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        document = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SettingsError(f"{SETTINGS_VAR} is not valid JSON: {exc}") from None
    if not isinstance(document, dict):
        raise SettingsError(f"{SETTINGS_VAR} must be a JSON object, got {type(document).__name__}")
    for key, var in _ENV_ONLY.items():
        if key in document:
            raise SettingsError(f"{SETTINGS_VAR} must not contain {key!r}: set {var} instead")
    return document
