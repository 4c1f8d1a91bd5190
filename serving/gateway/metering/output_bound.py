"""The most output tokens the engine may generate for one request body (pure code).

The gateway reserves, limits and bills output by this number, so it must be the engine's own
rule, not the OpenAI documentation's: the pinned vLLM (0.32) decides it in
`entrypoints/openai/{chat_completion,completion}/serving.py` (`get_max_tokens`, then the request
class's `to_sampling_params`). Restated here because the gateway must not import vLLM; a
differential test (tests/serving/gateway/metering/test_output_bound.py) checks every rule below against
vLLM's own classes.

- Chat takes `max_completion_tokens` when it is not null, else `max_tokens`: a body with
  `max_tokens: 1, max_completion_tokens: 4096` generates up to 4096.
- /v1/completions reads `max_tokens` only (null means 16, the OpenAI default vLLM keeps);
  `max_completion_tokens` is not one of its fields and vLLM ignores it. `echo` with
  `max_tokens: 0` generates one token.
- With no limit, vLLM generates up to the model's context length minus the prompt, so the
  context length bounds it when the gateway knows it and it is within `max_tokens_ceiling`;
  otherwise the gateway adds `max_tokens: <ceiling>` to the upstream body, which then bounds it.
- Every prompt generates `n` sequences (null: 1). /v1/completions takes a list of prompts (strings
  or token-id lists) and vLLM's `prompt_embeds`, each one a request of its own. `best_of` is
  not a field of vLLM 0.32: it is ignored, so it generates nothing.
- `min_tokens` and `ignore_eos` only make the engine reach the limit; they never raise it.
- Beam search (`use_beam_search`) generates and re-reads candidates per step, which no
  per-request number bounds: refused.

A body whose count cannot be computed - a limit that is not a JSON integer (vLLM would coerce
4096.0, "4096" or true), beam search, an `echo` that is not a boolean - is refused (`unbounded`),
never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens default (null is read as it)


@dataclass(frozen=True)
class OutputBound:
    """Output tokens a request may generate: `per_sequence` for each of `sequences` per prompt
    (n), for each of `prompts`. `added_max_tokens`: the max_tokens the gateway must add to the
    upstream body for that bound to hold (None: add nothing)."""

    per_sequence: int
    sequences: int = 1
    prompts: int = 1
    added_max_tokens: int | None = None

    @property
    def total(self) -> int:
        return self.per_sequence * self.sequences * self.prompts


NO_OUTPUT = OutputBound(per_sequence=0)


@dataclass(frozen=True)
class Unbounded:
    """Why a body's output cannot be bounded: the parameter and a message for the caller."""

    param: str
    message: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(value: Any) -> int:
    """How many prompts vLLM makes of a `prompt` (or `prompt_embeds`) value (vLLM's
    `prompt_to_seq`): a string, a token-id list or one embedding is one; any other list is one each."""
    if value is None:
        return 0
    if isinstance(value, list) and value and not all(_is_int(item) for item in value):
        return len(value)
    return 1


def prompt_count(document: dict[str, Any], path: str) -> int:
    """Prompts one request generates for: /v1/completions' `prompt` and `prompt_embeds` together,
    at least one; a chat request is one conversation."""
    if path != COMPLETIONS:
        return 1
    return max(1, _count(document.get("prompt")) + _count(document.get("prompt_embeds")))


def unbounded(document: dict[str, Any], path: str) -> Unbounded | None:
    """Why `document` (a completions body) cannot be bounded, or None when `output_bound` can."""
    fields = ["max_tokens", "n"] + (["max_completion_tokens"] if path == CHAT else [])
    for param in fields:
        value = document.get(param)
        if value is not None and not _is_int(value):
            return Unbounded(param, f"'{param}' must be an integer or null.")
    for param in ("echo", "use_beam_search"):
        value = document.get(param)
        if value is not None and not isinstance(value, bool):
            return Unbounded(param, f"'{param}' must be a boolean or null.")
    if document.get("use_beam_search"):
        return Unbounded(
            "use_beam_search", "Beam search is not served by this gateway: its cost cannot be bounded before it runs."
        )
    return None


def requested_limit(document: dict[str, Any], path: str) -> int | None:
    """The output limit per sequence the body itself sets, as vLLM reads it; None when it sets none
    (and vLLM's default applies)."""
    if path == CHAT:
        limit = document.get("max_completion_tokens")
        return limit if limit is not None else document.get("max_tokens")
    limit = document.get("max_tokens")
    if limit == 0 and document.get("echo") is True:
        return 1  # echo without generation still runs one step (CompletionRequest.to_sampling_params)
    return limit


def output_bound(
    document: dict[str, Any] | None, path: str, *, context_length: int | None, ceiling: int
) -> OutputBound:
    """The bound for a body `unbounded` found nothing wrong with (module docstring). Paths
    other than the completions ones generate nothing."""
    if document is None or path not in (CHAT, COMPLETIONS):
        return NO_OUTPUT
    n = document.get("n")
    sequences = n if n is not None else 1
    prompts = prompt_count(document, path)
    limit = requested_limit(document, path)
    if limit is not None:
        per_sequence = limit if context_length is None else min(limit, context_length)
        return OutputBound(per_sequence=per_sequence, sequences=sequences, prompts=prompts)
    # No limit sent: vLLM's default is the rest of the context (chat) or 16 (completions).
    default = context_length if path == CHAT else COMPLETION_DEFAULT_MAX_TOKENS
    if default is not None and context_length is not None:
        default = min(default, context_length)
    if default is not None and default <= ceiling:
        return OutputBound(per_sequence=default, sequences=sequences, prompts=prompts)
    return OutputBound(per_sequence=ceiling, sequences=sequences, prompts=prompts, added_max_tokens=ceiling)
