"""Request policy (OWASP LLM10 "Unbounded Consumption"): a pure check of the
JSON body of `/v1/chat/completions` and `/v1/completions`, run at admission before the limiter
charges anything, so a refused request costs the key no quota.

Rules (ceilings come from `GatewaySettings`):

- `max_tokens`, `max_completion_tokens` (and vLLM's `min_tokens`): at most `max_tokens_ceiling`.
- `n` (and legacy/vLLM `best_of`, which multiplies work the same way): at most `max_n`.
- `logit_bias`: refused when non-empty unless `allow_logit_bias`.
- `top_logprobs`, legacy integer `logprobs` on /v1/completions (and vLLM's `prompt_logprobs`):
  at most `max_top_logprobs`. On chat, `logprobs` is a boolean.
- The body must be a JSON object. `null` means "not set" for every field above.

Types are checked strictly: only JSON integers (not booleans, floats or numeric strings) pass
as integers. The upstream (vLLM's pydantic models) would coerce "5000" or 5000.0 to 5000, so
anything looser here would be a way around the ceilings. Messages never echo the value sent
(it can be arbitrarily large); they name the parameter and the limit.

Nothing else is read from the body; in particular the upstream address never comes from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.gateway.metering import COMPLETION_PATHS
from serving.gateway.settings import GatewaySettings

ABOVE_MAX = "integer_above_max_value"
BELOW_MIN = "integer_below_min_value"
INVALID_TYPE = "invalid_type"
LOGIT_BIAS_REFUSED = "logit_bias_not_allowed"
NOT_AN_OBJECT = "invalid_request_body"


@dataclass(frozen=True)
class PolicyViolation:
    """Why a request is refused: the parameter (None for the body as a whole), a message for
    the caller, and an OpenAI-style error code. Always answered with 400 invalid_request_error."""

    param: str | None
    message: str
    code: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _bounded_int(document: dict[str, Any], param: str, low: int, high: int, why: str) -> PolicyViolation | None:
    """`param` absent or null, or an integer in [low, high]; else the violation."""
    value = document.get(param)
    if value is None:
        return None
    if not _is_int(value):
        return PolicyViolation(param, f"'{param}' must be an integer or null.", INVALID_TYPE)
    if value < low:
        return PolicyViolation(param, f"'{param}' must be at least {low}.", BELOW_MIN)
    if value > high:
        return PolicyViolation(param, f"'{param}' must be at most {high} {why}.", ABOVE_MAX)
    return None


def check_request(document: dict | None, path: str, settings: GatewaySettings) -> PolicyViolation | None:
    """The first policy violation in a completions request body, or None to admit it.
    `document` is the parsed body (None when it is not a JSON object); other paths pass."""
    if path not in COMPLETION_PATHS:
        return None
    if not isinstance(document, dict):
        return PolicyViolation(None, "The request body must be a JSON object.", NOT_AN_OBJECT)

    ceiling = settings.max_tokens_ceiling
    tokens_why = f"(this gateway's max_tokens ceiling is {ceiling})"
    n_why = f"(this gateway's ceiling for choices per request is {settings.max_n})"
    logprobs_why = f"(this gateway's ceiling for logprobs per token is {settings.max_top_logprobs})"
    checks = [
        ("max_tokens", 1, ceiling, tokens_why),
        ("max_completion_tokens", 1, ceiling, tokens_why),
        ("min_tokens", 0, ceiling, tokens_why),  # vLLM: forces output length, so it is a budget too
        ("n", 1, settings.max_n, n_why),
        ("best_of", 1, settings.max_n, n_why),  # generates best_of candidates server-side, like n
        ("top_logprobs", 0, settings.max_top_logprobs, logprobs_why),
        ("prompt_logprobs", 0, settings.max_top_logprobs, logprobs_why),  # vLLM: logprobs of the prompt
    ]
    if path == "/v1/completions":  # legacy form: logprobs is the number of top logprobs per token
        checks.append(("logprobs", 0, settings.max_top_logprobs, logprobs_why))
    for param, low, high, why in checks:
        violation = _bounded_int(document, param, low, high, why)
        if violation is not None:
            return violation
    if path == "/v1/chat/completions" and document.get("logprobs") is not None \
            and not isinstance(document["logprobs"], bool):
        return PolicyViolation("logprobs", "'logprobs' must be a boolean or null.", INVALID_TYPE)

    # logit_bias lets a caller push chosen tokens up or down and read how the distribution
    # moves: with logprobs it recovers full-vocabulary logits, a known model-extraction lever
    # (OWASP LLM10; Carlini et al. 2024, "Stealing Part of a Production Language Model").
    # Refused by default; a stack that needs it (e.g. constrained classification) turns it on.
    logit_bias = document.get("logit_bias")
    if logit_bias is not None:
        if not isinstance(logit_bias, dict):
            return PolicyViolation("logit_bias", "'logit_bias' must be an object or null.", INVALID_TYPE)
        if logit_bias and not settings.allow_logit_bias:
            return PolicyViolation("logit_bias", "'logit_bias' is not allowed by this gateway.", LOGIT_BIAS_REFUSED)
    return None
