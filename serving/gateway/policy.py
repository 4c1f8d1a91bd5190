"""The gateway's policy: limits, ceilings and timeouts, each field and its bound written once.

The stack spec (`infra.spec.Gateway`, read from `llmstack:gateway` in a stack file) and the
gateway's own settings (`serving.gateway.settings.GatewaySettings`, read from the pod's
environment) both extend `GatewayPolicy`, and the renderer copies these fields from one to the
other with `policy_settings()`, so a bound checked by `llmctl plan` is the bound the gateway
enforces at start.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    # Unknown keys are typos or version skew between the renderer and the image: fail loudly.
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeyLimits(_Strict):
    """Per-key limits: the gateway's defaults; a key's own overrides (KeyRecord) win."""

    requests_per_minute: int = Field(default=60, ge=1, description="Request rate (GCRA).")
    tokens_per_minute: int = Field(default=100_000, ge=1, description="Prompt + output tokens rate.")
    daily_token_budget: int = Field(default=2_000_000, ge=1, description="Tokens per UTC day.")
    max_concurrent_requests: int = Field(default=8, ge=1, description="In-flight requests per key.")


class TenantLimits(_Strict):
    """Limits shared by every key of one tenant, on top of each key's own. None: no such limit.
    `llmctl tenants set` stores a tenant's own values in Redis; they win over these defaults."""

    requests_per_minute: int | None = Field(default=None, ge=1, description="Request rate of all the tenant's keys.")
    tokens_per_minute: int | None = Field(default=None, ge=1, description="Token rate of all the tenant's keys.")
    daily_token_budget: int | None = Field(default=None, ge=1, description="Tokens per UTC day, all keys.")
    max_concurrent_requests: int | None = Field(default=None, ge=1, description="In-flight requests, all keys.")


class GatewayPolicy(_Strict):
    port: int = Field(default=8080, ge=1024, le=65535,
                      description="Port the gateway listens on (unprivileged: the pod runs as non-root).")
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="Largest request body; larger gets 413.")
    default_limits: KeyLimits = Field(default_factory=KeyLimits, description="Per-key defaults.")
    default_tenant_limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="Per-tenant defaults (none by default); `llmctl tenants set` overrides them per tenant.",
    )
    max_tokens_ceiling: int = Field(
        default=4096, ge=1,
        description="Largest max_tokens accepted (serving.gateway.request_policy); also the output reserved "
                    "when a request sets none.",
    )
    max_n: int = Field(
        default=4, ge=1,
        description="Most sequences one request may generate: n (or best_of) times the number of prompts.",
    )
    max_top_logprobs: int = Field(
        default=5, ge=0,
        description="Largest top_logprobs (and legacy integer logprobs on /v1/completions) accepted.",
    )
    allow_logit_bias: bool = Field(
        default=False,
        description="Accept a non-empty logit_bias. Off by default: with logprobs it is a model-extraction lever.",
    )
    chat_template_tokens: int = Field(
        default=256, ge=0,
        description="Tokens a served model's chat template may add to a chat request besides its messages "
                    "(default system prompt, tool-use instructions); part of the prompt bound reserved at admission.",
    )
    limiter_fail_mode: Literal["local", "closed"] = Field(
        default="local",
        description="When the limiter's Redis fails: per-replica in-memory limits (local), or 503 (closed). "
                    "A busy Redis pool is load, not a failure: always 503 + Retry-After.",
    )
    shadow_max_concurrent_requests: int = Field(
        default=64, ge=1,
        description="A key in shadow mode is served over its own limits, but never with more requests than this "
                    "in flight.",
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
        default=90.0, ge=0, le=105,
        description="After SIGTERM, how long in-flight streams may run: within the pod's 120 s grace period, "
                    "after its 10 s preStop pause.",
    )

    def policy_settings(self) -> dict[str, Any]:
        """The policy fields alone, as JSON values: what the renderer hands the gateway."""
        return self.model_dump(mode="json", include=set(GatewayPolicy.model_fields))
