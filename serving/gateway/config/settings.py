"""Gateway settings: read once from the environment at start, validated, then immutable.

The Kubernetes Deployment (rendered by `infra/render/gateway.py`) sets three variables:

- `LLMSTACK_UPSTREAM_URL`: Ray Serve's OpenAI ingress. The only place the upstream address
  comes from - never from a request.
- `LLMSTACK_GATEWAY_SETTINGS`: JSON with the non-secret settings (port, limits, models...).
- `LLMSTACK_REDIS_URL`: from a Secret; unset or empty means the embedded in-memory key store.

`LLMSTACK_GATEWAY_HOST` / `LLMSTACK_GATEWAY_METRICS_HOST` / `LLMSTACK_GATEWAY_PORT` /
`LLMSTACK_GATEWAY_METRICS_PORT` override the bind addresses and ports (local dev, tests).
The policy fields (limits, ceilings, timeouts, transport bounds) are
`serving.gateway.config.gateway_policy.GatewayPolicy`, the model the stack spec extends too; they are validated
here so a bad render fails at start.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator

from serving.gateway.config.capacity_policy import ModelCapacity
from serving.gateway.config.gateway_policy import GatewayPolicy, checked_domains
from serving.gateway.config.queue_policy import ModelQueue
from serving.gateway.config.tracing_policy import TracingPolicy
from serving.gateway.protocol.routes import is_canonical

UPSTREAM_VAR = "LLMSTACK_UPSTREAM_URL"
SETTINGS_VAR = "LLMSTACK_GATEWAY_SETTINGS"
REDIS_VAR = "LLMSTACK_REDIS_URL"
HOST_VAR = "LLMSTACK_GATEWAY_HOST"
METRICS_HOST_VAR = "LLMSTACK_GATEWAY_METRICS_HOST"
PORT_VAR = "LLMSTACK_GATEWAY_PORT"
METRICS_PORT_VAR = "LLMSTACK_GATEWAY_METRICS_PORT"
RAY_AUTH_TOKEN_VAR = "LLMSTACK_RAY_AUTH_TOKEN"
# Ray Serve LLM's name for an adapter on a base model: `<base>:<adapter>` (serving.gateway.auth.adapter_access).
ADAPTER_SEPARATOR = ":"
# An adapter id is a folder name under the stack's adapter prefix: no separator, no path parts.
ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SettingsError(ValueError):
    """A bad environment; the message is one line that names the variable to fix."""


class GatewaySettings(GatewayPolicy):
    """The policy (serving.gateway.config.gateway_policy) plus where this process finds the upstream, Redis and
    its models."""

    upstream_url: str = Field(description="Base URL of Ray Serve's OpenAI ingress, e.g. http://host:8000.")
    redis_url: str | None = Field(
        default=None,
        description="Redis for keys and limits. None: in-memory keys and limits, single process only.",
    )
    host: str = Field(default="127.0.0.1", description="Address the API binds: loopback behind the edge (HAProxy).")
    metrics_host: str | None = Field(
        default=None,
        description="Address the metrics port binds (0.0.0.0 in a pod: Prometheus and the kubelet "
        "reach it); None: the same as host.",
    )
    models: list[str] = Field(default_factory=list, description="Model names the upstream serves.")
    model_adapters: dict[str, list[str]] = Field(
        default_factory=dict,
        description="LoRA adapters served on each base model (base name -> adapter ids), rendered from the "
        "stack file. A client names one as `<base>:<adapter>`; it is visible only to keys and tenants "
        "granted it (serving.gateway.auth.adapter_access).",
    )
    model_context_lengths: dict[str, int] = Field(
        default_factory=dict,
        description="max_model_len per served model: how much output a request without max_tokens can get, "
        "and the most prompt tokens one prompt can be.",
    )
    model_media_domains: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Per served model, the hosts it may fetch media from when it has a list of its own "
        "(models[].allowed_media_domains); other models use allowed_media_domains.",
    )
    model_usd_per_million_tokens: dict[str, Annotated[Decimal, Field(ge=0)]] = Field(
        default_factory=dict,
        description="Rate card per served model: USD per 1M prompt + completion tokens (infra.plan.cost.rate_card, "
        "derived from the stack's plan and prices, so not policy). Monthly budgets charge requests at "
        "it; a model without a rate costs nothing and no budget stops it.",
    )
    model_routes: dict[str, str] = Field(
        default_factory=dict,
        description="Route prefix of each model's own Serve application (direct serving path), e.g. "
        '{"tiny-chat": "/tiny-chat"}; models not listed go to `/` (serving.gateway.protocol.routes).',
    )
    model_queues: dict[str, ModelQueue] = Field(
        default_factory=dict,
        description="Capacity per served model (replicas x max_ongoing_requests) for the fair queue; a model "
        "not named here is never queued.",
    )
    model_capacities: dict[str, ModelCapacity] = Field(
        default_factory=dict,
        description="Latency targets and capacity bounds per served model (serving.gateway.capacity): a queued "
        "model listed here with adaptive on has its capacity per replica moved between min_slots and "
        "max_slots to keep its targets; any other model keeps max_ongoing_requests per replica.",
    )
    serve_dashboard_url: str | None = Field(
        default=None,
        description="Ray dashboard base URL (e.g. http://<head service>:8265) whose REST API says how many replicas "
        "each model runs (serving.gateway.queue.replica_feed). None: capacity stays the stack's figure.",
    )
    model_deployments: dict[str, str] = Field(
        default_factory=dict,
        description="Serve deployment that runs each served model (LLMServer:<name>), for the replica feed.",
    )
    replica_poll_s: float = Field(default=5.0, gt=0, description="How often the replica feed asks the dashboard.")
    ray_auth_token: SecretStr | None = Field(
        default=None,
        description="Ray's token (token authentication: Ray 2.60's default for a local ray.init, off for "
        "`ray start` without a token), sent to the dashboard as a bearer token. Environment only.",
    )

    tracing: TracingPolicy = Field(
        default_factory=TracingPolicy,
        description="The stack's observability.tracing: OpenTelemetry spans per request (serving.gateway.telemetry."
        "tracing). Off by default.",
    )

    batch_storage_url: str | None = Field(
        default=None,
        description="Where batch files live: file:///abs/dir (make dev) or s3://bucket/prefix (the stack's model "
        "cache bucket, under batches/). None: no Batch API.",
    )

    @model_validator(mode="after")
    def _adapters_on_served_bases(self) -> GatewaySettings:
        for base, adapters in self.model_adapters.items():
            if base not in self.models:
                raise ValueError(f"model_adapters names base model {base!r}, which is not in models {self.models}")
            for adapter in adapters:
                if not ADAPTER_ID.fullmatch(adapter):
                    raise ValueError(
                        f"adapter id {adapter!r} of {base!r} must be a folder name: letters, digits, . _ - "
                        "(no ':' or '/'), at most 128 characters"
                    )
        for model in self.models:
            if ADAPTER_SEPARATOR in model:
                raise ValueError(
                    f"served model name {model!r} must not contain {ADAPTER_SEPARATOR!r} (adapters use it)"
                )
        return self

    @field_validator("model_media_domains")
    @classmethod
    def _model_media_domains(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for domains in value.values():
            checked_domains(domains)
        return value

    def media_domains(self, model: str | None) -> list[str]:
        """The hosts a request naming `model` may have the engine fetch media from."""
        return self.model_media_domains.get(model or "", self.allowed_media_domains)

    @field_validator("batch_storage_url")
    @classmethod
    def _storage_url(cls, value: str | None) -> str | None:
        if value is not None and not (value.startswith("file:///") or value.startswith("s3://")):
            raise ValueError(f"must be file:///absolute/dir or s3://bucket/prefix, got {value!r}")
        return value

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

    @field_validator("serve_dashboard_url")
    @classmethod
    def _dashboard_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        return value

    @field_validator("model_routes")
    @classmethod
    def _route_prefixes(cls, value: dict[str, str]) -> dict[str, str]:
        # The prefix is put before the canonical path and sent already encoded: it must be
        # canonical itself, or it would reopen the double-decoding the route allowlist closes.
        for model, prefix in value.items():
            if prefix != "/" and not is_canonical(prefix.rstrip("/")):
                raise ValueError(
                    f"route prefix of {model!r} must be a plain absolute path like /my-model "
                    f"(letters, digits, - . _ ~ and /; no . or .. segments), got {prefix!r}"
                )
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("redis://", "rediss://", "unix://")):
            # Never echo the value: it may carry the Redis AUTH token.
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value


# Keys that only the dedicated variables may set: secrets and the upstream stay out of the JSON.
_ENV_ONLY = {"upstream_url": UPSTREAM_VAR, "redis_url": REDIS_VAR, "ray_auth_token": RAY_AUTH_TOKEN_VAR}


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
    take(METRICS_HOST_VAR, "metrics_host")
    take(PORT_VAR, "port")
    take(METRICS_PORT_VAR, "metrics_port")
    take(RAY_AUTH_TOKEN_VAR, "ray_auth_token")
    try:
        return GatewaySettings.model_validate(values)
    except ValidationError as exc:
        error = exc.errors()[0]
        path = ".".join(str(part) for part in error["loc"])
        field = str(error["loc"][0]) if error["loc"] else ""
        where = sources.get(field) or (f"{SETTINGS_VAR} key {path!r}" if path else SETTINGS_VAR)
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
