"""What the limiter answered for one admission, and how a client is told: OpenAI's
`x-ratelimit-*` headers and `Retry-After`. Pure: the Redis and the local limiter both answer one."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LimitDecision:
    """What the limiter answered for one admission (Redis or the local fallback)."""

    allowed: bool
    refused: str | None  # "requests" | "tokens" | "concurrency" | "daily_tokens"
    limit_requests: int
    remaining_requests: int
    reset_requests_s: float
    limit_tokens: int
    remaining_tokens: int
    reset_tokens_s: float
    retry_after_s: float | None  # None: this request can never fit (it asks for more than a whole limit)
    scope: str | None = None  # whose limit refused: "key", "tenant", or "shadow" (a shadow key's would-be refusal)


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI writes `x-ratelimit-reset-*`: "12ms", "1s", "1.5s", "6m0s"."""
    seconds = max(0.0, seconds)
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    hours, minutes = divmod(int(minutes), 60)
    text = f"{round(rest, 3):.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text


def retry_after_value(seconds: float) -> str:
    """`Retry-After` is whole seconds: round up, so a client that waits exactly that long fits."""
    return str(max(1, math.ceil(seconds)))


def rate_limit_headers(decision: LimitDecision) -> dict[str, str]:
    headers = {
        "x-ratelimit-limit-requests": str(decision.limit_requests),
        "x-ratelimit-remaining-requests": str(max(0, decision.remaining_requests)),
        "x-ratelimit-reset-requests": format_reset(decision.reset_requests_s),
        "x-ratelimit-limit-tokens": str(decision.limit_tokens),
        "x-ratelimit-remaining-tokens": str(max(0, decision.remaining_tokens)),
        "x-ratelimit-reset-tokens": format_reset(decision.reset_tokens_s),
    }
    if not decision.allowed and decision.retry_after_s is not None:
        headers["retry-after"] = retry_after_value(decision.retry_after_s)
    return headers
