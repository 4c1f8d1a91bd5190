"""The stack's tracing settings (`observability.tracing`): where every layer sends its spans
and how many requests are traced. One model for the stack spec and the gateway's settings, so
what `llmctl plan` checks is what the gateway, Ray Serve and vLLM are given."""

from __future__ import annotations

from pydantic import Field, field_validator

from serving.gateway.config.strict_model import StrictModel

OTLP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path for spans (the OTLP specification's default)
DEFAULT_SAMPLING_RATIO = 0.01  # Ray Serve's own default (RAY_SERVE_TRACING_SAMPLING_RATIO)


class TracingPolicy(StrictModel):
    """OpenTelemetry traces from the gateway through Ray Serve into the vLLM engine. Off unless
    `otlp_endpoint` is set: then nothing of the SDK is loaded and no span is made."""

    otlp_endpoint: str | None = Field(
        default=None,
        description="OTLP/HTTP collector base URL (e.g. http://otel-collector.monitoring:4318); spans go to "
        "its /v1/traces. None: tracing off in every layer.",
    )
    sampling_ratio: float = Field(
        default=DEFAULT_SAMPLING_RATIO,
        ge=0.0,
        le=1.0,
        description="Share of requests traced, decided once at the gateway; Ray Serve and vLLM follow that "
        "decision (parent-based sampling), so a trace is whole or absent.",
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"otlp_endpoint {value!r} must be an http:// or https:// URL (OTLP over HTTP)")
        return value.rstrip("/") if value is not None else None

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @property
    def traces_url(self) -> str | None:
        """Where spans are posted: the endpoint's /v1/traces (an exporter given a URL uses it as is)."""
        return None if self.otlp_endpoint is None else self.otlp_endpoint + OTLP_TRACES_PATH
