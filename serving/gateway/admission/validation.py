"""Request policy (OWASP LLM10 "Unbounded Consumption"): a pure check of the JSON body of
`/v1/chat/completions` and `/v1/completions`, run at admission before the limiter charges
tokens, so a refused request costs the key no token quota.

Rules (ceilings come from `GatewaySettings`):

- `max_tokens`, `max_completion_tokens` (and vLLM's `min_tokens`): at most `max_tokens_ceiling`.
- `n` (and legacy/vLLM `best_of`, which multiplies work the same way), times the number of
  prompts (/v1/completions takes a list of prompts, each generating n sequences): at most `max_n`.
- `logit_bias`: refused when non-empty unless `allow_logit_bias`.
- `top_logprobs`, legacy integer `logprobs` on /v1/completions (and vLLM's `prompt_logprobs`):
  at most `max_top_logprobs`. On chat, `logprobs` is a boolean.
- A body whose output the gateway cannot bound by the engine's rule (serving.gateway.metering.output_bound:
  beam search, a limit that is not an integer) is refused: its reservation would be a guess.
- `chat_template`: refused. A template sent with the request can expand a short body into any
  number of prompt tokens, so no reservation could bound it.
- The body must be a JSON object. `null` means "not set" for every field above.

Types are checked strictly for every field the gateway decides on: only JSON integers (not
booleans, floats or numeric strings) pass as integers, only true/false as booleans (`stream`,
`stream_options.include_usage` and `continuous_usage_stats`, chat's `logprobs`), `model` is a
string, `messages` a list of objects, `prompt` a string, a list of strings or token-id lists.
The upstream (vLLM's lax pydantic models) would coerce "5000" or 5000.0 to 5000 and "true",
"yes" or 1 to true, so a looser check here would let a request be one thing to the gateway
(not a stream, within the ceilings) and another to the model server. Messages never echo the
value sent (it can be arbitrarily large); they name the parameter and the limit.

Nothing else is read from the body; in particular the upstream address never comes from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.gateway.config.gateway_policy import GatewayPolicy
from serving.gateway.metering.output_bound import unbounded
from serving.gateway.metering.reservation import COMPLETION_PATHS, choices_per_prompt, prompt_count

ABOVE_MAX = "integer_above_max_value"
BELOW_MIN = "integer_below_min_value"
INVALID_TYPE = "invalid_type"
LOGIT_BIAS_REFUSED = "logit_bias_not_allowed"
CHAT_TEMPLATE_REFUSED = "chat_template_not_allowed"
NOT_AN_OBJECT = "invalid_request_body"
UNBOUNDED_OUTPUT = "output_not_bounded"


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


def _typed(document: dict[str, Any], param: str, kind: type | tuple[type, ...], what: str) -> PolicyViolation | None:
    value = document.get(param)
    if value is None or (isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))):
        return None
    return PolicyViolation(param, f"'{param}' must be {what} or null.", INVALID_TYPE)


def _token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(i) and i >= 0 for i in value)


def _check_shapes(document: dict[str, Any], path: str) -> PolicyViolation | None:
    """The strict types of the fields the gateway decides on (module docstring)."""
    for param, kind, what in [
        ("stream", bool, "a boolean"),
        ("model", str, "a string"),
        ("stream_options", dict, "an object"),
    ]:
        violation = _typed(document, param, kind, what)
        if violation is not None:
            return violation
    for option in ("include_usage", "continuous_usage_stats"):
        violation = _typed(document.get("stream_options") or {}, option, bool, "a boolean")
        if violation is not None:
            return PolicyViolation(f"stream_options.{option}", violation.message, INVALID_TYPE)
    if path == "/v1/chat/completions":
        messages = document.get("messages")
        if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            return PolicyViolation("messages", "'messages' must be a list of message objects.", INVALID_TYPE)
        if document.get("logprobs") is not None and not isinstance(document["logprobs"], bool):
            return PolicyViolation("logprobs", "'logprobs' must be a boolean or null.", INVALID_TYPE)
    if path == "/v1/completions":
        prompt = document.get("prompt")
        if not (
            prompt is None
            or isinstance(prompt, str)
            or _token_ids(prompt)
            or (
                isinstance(prompt, list)
                and prompt
                and (all(isinstance(p, str) for p in prompt) or all(_token_ids(p) for p in prompt))
            )
        ):
            return PolicyViolation(
                "prompt",
                "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists.",
                INVALID_TYPE,
            )
    if document.get("chat_template") is not None:
        return PolicyViolation(
            "chat_template",
            "'chat_template' is not allowed by this gateway: requests use the model's own chat template.",
            CHAT_TEMPLATE_REFUSED,
        )
    return None


def check_request(document: dict[str, Any] | None, path: str, settings: GatewayPolicy) -> PolicyViolation | None:
    """The first policy violation in a completions request body, or None to admit it.
    `document` is the parsed body (None when it is not a JSON object); other paths pass."""
    if path not in COMPLETION_PATHS:
        return None
    if not isinstance(document, dict):
        return PolicyViolation(None, "The request body must be a JSON object.", NOT_AN_OBJECT)
    violation = _check_shapes(document, path)
    if violation is not None:
        return violation

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
    prompts, sequences = prompt_count(document, path), choices_per_prompt(document)
    if prompts > 1 and sequences * prompts > settings.max_n:
        return PolicyViolation(
            "prompt",
            f"{prompts} prompts of {sequences} sequences each is more than the "
            f"{settings.max_n} sequences this gateway allows per request.",
            ABOVE_MAX,
        )
    # After the ceilings, so a refusal names the ceiling; before anything is reserved.
    cannot_bound = unbounded(document, path)
    if cannot_bound is not None:
        return PolicyViolation(cannot_bound.param, cannot_bound.message, UNBOUNDED_OUTPUT)

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
