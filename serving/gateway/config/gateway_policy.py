"""The gateway's policy: limits, ceilings and timeouts, each field and its bound written once.

The stack spec (`infra.spec.Gateway`, read from `llmstack:gateway` in a stack file) and the
gateway's own settings (`serving.gateway.config.settings.GatewaySettings`, read from the pod's
environment) both extend `GatewayPolicy`, and the renderer copies these fields from one to the
other with `policy_settings()`, so a bound checked by `llmctl plan` is the bound the gateway
enforces at start.
"""

from __future__ import annotations

import re
from decimal import Decimal
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serving.gateway.config.batch_policy import BatchPolicy
from serving.gateway.config.queue_policy import QueuePolicy
from serving.gateway.config.resume_policy import ResumeSettings
from serving.gateway.config.strict_model import StrictModel

# Body fields a stack may not allow: each is an engine input no tenant should set.
NEVER_FROM_CLIENTS = frozenset({"request_id", "kv_transfer_params", "chat_template", "logits_processors", "priority"})
NEVER_FROM_CLIENTS_WHY = (
    "request_id names the engine request (a chosen one can collide with, and abort, another "
    "tenant's), kv_transfer_params steer disaggregated prefill internals, chat_template is "
    "caller-supplied Jinja run on the server, logits_processors load code by name, priority is "
    "the gateway's to set from the key's tier (gateway.queue.engine_priority)"
)
NEVER_FORWARDED_HEADERS = frozenset(
    {
        "authorization",
        "x-api-key",
        "cookie",
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "proxy-authorization",
        "x-request-id",
        "accept-encoding",
    }
)

# A lower-case DNS name of two or more labels, at least one letter somewhere (so no IPv4 literal).
_DOMAIN = re.compile(r"(?=.*[a-z])[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)+")


def checked_domains(domains: list[str]) -> list[str]:
    """`domains` as given, or ValueError naming the first that is not a lower-case DNS name
    (no scheme, port, path, wildcard or IP address: vLLM compares the URL's host exactly)."""
    for domain in domains:
        if not _DOMAIN.fullmatch(domain) or domain.rsplit(".", 1)[-1].isdigit():
            raise ValueError(
                f"{domain!r} is not a domain name such as images.example.com (lower case; no scheme, "
                "port, path, wildcard or IP address: media URLs must name this exact host)"
            )
    return domains


class KeyLimits(StrictModel):
    """Per-key limits: the gateway's defaults; a key's own overrides (KeyRecord) win."""

    requests_per_minute: int = Field(default=60, ge=1, description="Request rate (GCRA).")
    tokens_per_minute: int = Field(default=100_000, ge=1, description="Prompt + output tokens rate.")
    daily_token_budget: int = Field(default=2_000_000, ge=1, description="Tokens per UTC day.")
    max_concurrent_requests: int = Field(default=8, ge=1, description="In-flight requests per key.")


class TenantLimits(StrictModel):
    """Limits shared by every key of one tenant, on top of each key's own. None: no such limit.
    `llmctl tenants set` stores a tenant's own values in Redis; they win over these defaults."""

    requests_per_minute: int | None = Field(default=None, ge=1, description="Request rate of all the tenant's keys.")
    tokens_per_minute: int | None = Field(default=None, ge=1, description="Token rate of all the tenant's keys.")
    daily_token_budget: int | None = Field(default=None, ge=1, description="Tokens per UTC day, all keys.")
    max_concurrent_requests: int | None = Field(default=None, ge=1, description="In-flight requests, all keys.")
    monthly_budget_usd: Decimal | None = Field(
        default=None,
        gt=0,
        max_digits=12,
        decimal_places=2,
        description="Dollars all the tenant's keys may spend per calendar month (UTC), at each model's rate card "
        "(serving.gateway.limits.budgets); stored as a decimal string in the tenant's limits hash.",
    )


class GatewayPolicy(StrictModel):
    port: int = Field(
        default=8080,
        ge=1024,
        le=65535,
        description="Port the gateway listens on (unprivileged: the pod runs as non-root).",
    )
    max_body_bytes: int = Field(default=1_000_000, ge=1024, description="Largest request body; larger gets 413.")
    default_limits: KeyLimits = Field(default_factory=KeyLimits, description="Per-key defaults.")
    default_tenant_limits: TenantLimits = Field(
        default_factory=TenantLimits,
        description="Per-tenant defaults (none by default); `llmctl tenants set` overrides them per tenant.",
    )
    max_tokens_ceiling: int = Field(
        default=4096,
        ge=1,
        description="Largest max_tokens accepted (serving.gateway.admission.validation); also the output reserved "
        "when a request sets none.",
    )
    max_n: int = Field(
        default=4,
        ge=1,
        description="Most sequences one request may generate: n (or best_of) times the number of prompts.",
    )
    max_top_logprobs: int = Field(
        default=5,
        ge=0,
        description="Largest top_logprobs (and legacy integer logprobs on /v1/completions) accepted.",
    )
    allow_logit_bias: bool = Field(
        default=False,
        description="Accept a non-empty logit_bias. Off by default: with logprobs it is a model-extraction lever.",
    )
    chat_template_tokens: int = Field(
        default=256,
        ge=0,
        description="Tokens a served model's chat template may add to a chat request besides its messages "
        "(default system prompt, tool-use instructions); part of the prompt bound reserved at admission.",
    )
    limiter_fail_mode: Literal["local", "closed"] = Field(
        default="local",
        description="When the limiter's Redis fails: per-replica in-memory limits (local), or 503 (closed). "
        "A busy Redis pool is load, not a failure: always 503 + Retry-After.",
    )
    shadow_max_concurrent_requests: int = Field(
        default=64,
        ge=1,
        description="A key in shadow mode is served over its own limits, but never with more requests than this "
        "in flight.",
    )
    upstream_idle_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="Longest silence from the upstream: before its first byte (a long queue) or between two "
        "chunks of a stream. Past it the request fails (504 before the first byte; cut stream after).",
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Longest a whole request may take, stream included; a stream still running is cut. "
        "Also bounds how long a crashed gateway's concurrency slot stays taken.",
    )
    key_cache_ttl_s: float = Field(
        default=60.0,
        ge=0,
        description="While Redis is unreachable, keys verified this recently are still accepted (0: never). "
        "With Redis up every request is checked there, so revocation is immediate.",
    )
    log_prompts: bool = Field(
        default=False,
        description="Add the request's messages/prompt to its access-log line. Off: prompts are tenants' data.",
    )
    queue: QueuePolicy = Field(
        default_factory=QueuePolicy,
        description="Fair, tiered wait for saturated models (serving.gateway.queue.fair_queue); needs Redis.",
    )
    batch: BatchPolicy = Field(
        default_factory=BatchPolicy,
        description="OpenAI's Batch API (/v1/files, /v1/batches), run at the queue's lowest tier; needs Redis.",
    )
    stream_resume: ResumeSettings = Field(
        default_factory=ResumeSettings,
        description="Resume a stream whose replica died on another replica, at most max_resumes times within "
        "request_timeout_s; past that the client gets an OpenAI error event (serving.gateway.resume).",
    )
    shutdown_grace_s: float = Field(
        default=90.0,
        ge=0,
        le=105,
        description="After SIGTERM, how long in-flight streams may run: within the pod's 120 s grace period, "
        "after its 10 s preStop pause.",
    )

    # --- exposure, transport bounds and what reaches the upstream -------------------------
    metrics_port: int = Field(
        default=9090,
        ge=1024,
        le=65535,
        description="Port for /metrics and /readyz. Kept off the public port: the Service does not publish it.",
    )
    max_connections: int = Field(
        default=256,
        ge=1,
        description="Connections (and requests) served at once; past it uvicorn answers 503. With "
        "max_body_bytes it bounds the memory request bodies can take.",
    )
    gc_gen0_threshold: int = Field(
        default=7_000,
        ge=700,
        le=1_000_000,
        description="Allocations between two collections of Python's youngest GC generation in the gateway "
        "process (Python's default: 700). Raised with the startup heap frozen once the gateway has started "
        "(serving.gateway.http.gc_tuning): the collector took 12-16% of a saturated gateway's CPU, 0.3-0.4% so.",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Longest a request may take to arrive whole (headers to last body byte); past it, 408.",
    )
    max_json_depth: int = Field(
        default=32,
        ge=2,
        le=200,
        description="Deepest nesting of arrays and objects accepted in a request body; deeper gets 400.",
    )
    allowed_body_extensions: list[str] = Field(
        default_factory=list,
        description="Top-level body fields beyond OpenAI's (vLLM extensions such as ignore_eos, top_k) "
        "the gateway passes on; any other unknown field gets 400.",
    )
    allowed_media_domains: list[str] = Field(
        default_factory=list,
        description="Hosts the models may fetch media (image_url, audio_url, video_url parts) from, e.g. "
        '["images.example.com"]; a model\'s own list (models[].allowed_media_domains) replaces it. '
        "Empty: only inline data: URLs; any other URL gets 400 at the gateway, and the engine is told the "
        "same list (vLLM's --allowed-media-domains).",
    )
    forward_request_headers: list[str] = Field(
        default_factory=list,
        description="Request headers passed to the upstream besides content-type and accept (e.g. traceparent). "
        "Everything else a client sends stays at the gateway.",
    )

    @field_validator("allowed_body_extensions")
    @classmethod
    def _no_engine_internals(cls, value: list[str]) -> list[str]:
        refused = sorted(set(value) & NEVER_FROM_CLIENTS)
        if refused:
            raise ValueError(f"{refused} must never come from a client: {NEVER_FROM_CLIENTS_WHY}")
        return value

    @field_validator("allowed_media_domains")
    @classmethod
    def _media_domains(cls, value: list[str]) -> list[str]:
        return checked_domains(value)

    @field_validator("forward_request_headers")
    @classmethod
    def _forwardable_headers(cls, value: list[str]) -> list[str]:
        names = [name.lower() for name in value]
        refused = sorted(set(names) & NEVER_FORWARDED_HEADERS)
        if refused:
            raise ValueError(f"{refused} are credentials, connection-level or set by the gateway itself")
        return names

    @model_validator(mode="after")
    def _separate_ports(self) -> GatewayPolicy:
        if self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port are both {self.port}: metrics must not share the public port")
        return self

    def policy_settings(self) -> dict[str, Any]:
        """The policy fields alone, as JSON values: what the renderer hands the gateway."""
        return self.model_dump(mode="json", include=set(GatewayPolicy.model_fields))
