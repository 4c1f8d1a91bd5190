"""Token accounting that needs no Redis (pure code): what to reserve at admission, what to bill
when the response ends, and the OpenAI-style rate-limit headers.

Reservation. At admission the gateway cannot know how many tokens a request will use, so it
reserves an upper-ish bound: a prompt *estimate* plus the most output the request allows.
The estimate is characters / 4 (rounded up, at least 1), the usual rule of thumb for English
BPE vocabularies; it is deliberately tokenizer-free (the gateway has no model files and must
stay cheap). Being wrong is harmless: when the response ends the reservation is settled to
the usage the upstream reports, so only the *timing* of admission depends on the estimate.

Billing. `UsageMeter` watches the relayed bytes: it reads `usage` from a JSON body, or from
the final SSE chunk of a stream (the gateway asks for it with `stream_options.include_usage`
and strips that chunk again when the client did not ask). A stream cut short before its usage
chunk is billed the prompt estimate plus one token per content chunk received - an
approximation (vLLM sends about one token per chunk) that bills what was generated, not the
whole reservation.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

CHARS_PER_TOKEN = 4
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
_EVENT_END = re.compile(rb"(\r?\n\r?\n)")  # SSE events end with a blank line (LF or CRLF)
_JSON_COPY_LIMIT = 4_000_000  # bodies are small; past this we stop keeping a copy and bill the reservation


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


def _text_chars(value: Any) -> int:
    """Characters of prompt text in a `content` / `prompt` / `input` value (strings, lists of
    strings, lists of token ids, or chat content parts with `text`)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):  # a token id: count it as one token's worth of characters
        return CHARS_PER_TOKEN
    if isinstance(value, list):
        return sum(_text_chars(item) for item in value)
    if isinstance(value, dict):
        return _text_chars(value.get("text")) + _text_chars(value.get("content"))
    return 0


def estimate_prompt_tokens(document: dict[str, Any]) -> int:
    """Estimated prompt tokens: characters / 4 of every message content and prompt/input
    string, rounded up, at least 1. An estimate only; settlement replaces it with real usage."""
    chars = _text_chars(document.get("prompt")) + _text_chars(document.get("input"))
    messages = document.get("messages")
    if isinstance(messages, list):
        chars += sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
    return max(1, math.ceil(chars / CHARS_PER_TOKEN))


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def output_allowance(ceiling: int, context_length: int | None) -> tuple[int, int | None]:
    """For a completion that sets no max_tokens: (tokens to reserve for its output, the
    max_tokens to add to the upstream request, or None to add nothing).

    The upstream (vLLM) lets such a request run to the model's context length. When that is
    within the ceiling it already bounds the output, and adding max_tokens could only make
    vLLM refuse long prompts (it checks prompt + max_tokens <= context). When the context is
    longer, the ceiling must be sent, or the reservation would not bound the output."""
    if context_length is not None and context_length <= ceiling:
        return context_length, None
    return ceiling, ceiling


def requested_output(document: dict[str, Any]) -> int | None:
    return _positive_int(document.get("max_tokens")) or _positive_int(document.get("max_completion_tokens"))


def reserve_tokens(document: dict[str, Any] | None, path: str, default_max_tokens: int) -> int:
    """Tokens to reserve at admission: prompt estimate + output allowance x choices for
    completions (choices: n, or best_of when larger, since vLLM generates best_of sequences),
    the prompt estimate alone for other bodies (embeddings), 0 without a body (GET)."""
    if document is None:
        return 0
    estimate = estimate_prompt_tokens(document)
    if path not in COMPLETION_PATHS:
        return estimate
    output = requested_output(document) or default_max_tokens
    choices = max(_positive_int(document.get("n")) or 1, _positive_int(document.get("best_of")) or 1)
    return estimate + output * choices


def wants_stream(document: dict[str, Any] | None, path: str) -> bool:
    return document is not None and path in COMPLETION_PATHS and document.get("stream") is True


def request_usage_upstream(document: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to send upstream with `stream_options.include_usage` on, and whether the
    client asked for usage itself (if not, the usage chunk is stripped on the way back)."""
    options = document.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    client_asked = options.get("include_usage") is True
    options["include_usage"] = True
    return {**document, "stream_options": options}, client_asked


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


@dataclass(frozen=True)
class Usage:
    prompt: int
    completion: int

    @property
    def total(self) -> int:
        return self.prompt + self.completion


def _usage(usage: Any) -> Usage | None:
    """OpenAI's `usage` object as numbers; None when it carries none. A total without parts
    (seen from some servers) is counted as prompt."""
    if not isinstance(usage, dict):
        return None
    prompt, completion, total = (usage.get(k) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    prompt = prompt if isinstance(prompt, int) else None
    completion = completion if isinstance(completion, int) else None
    if prompt is None and completion is None:
        return Usage(total, 0) if isinstance(total, int) else None
    return Usage(prompt or 0, completion or 0)


class UsageMeter:
    """Watches one relayed response body and says what to bill.

    `feed(chunk)` returns the bytes to send to the client now; `finish()` the bytes held back
    to the very end (the JSON body's last chunk, or a stream's `data: [DONE]`), which the relay
    sends only after settlement, so a client that has the whole answer also sees its refund.
    """

    def __init__(self, *, stream: bool, strip_usage: bool, prompt_estimate: int, reserved: int) -> None:
        self.stream, self.strip_usage = stream, strip_usage
        self.prompt_estimate, self.reserved = prompt_estimate, reserved
        self.status = 200
        self.usage: Usage | None = None  # as the upstream reported it
        self.content_chunks = 0
        self.first_token_at: float | None = None  # time.perf_counter() of the first generated text
        self._pending = b""
        self._done = b""  # a stream's `data: [DONE]`, held back until settlement
        self._copy: list[bytes] | None = []
        self._copied = 0

    def feed(self, chunk: bytes) -> bytes:
        if not self.stream:
            if self._copy is not None:
                self._copy.append(chunk)
                self._copied += len(chunk)
                if self._copied > _JSON_COPY_LIMIT:
                    self._copy = None
            out, self._pending = self._pending, chunk
            return out
        parts = _EVENT_END.split(self._pending + chunk)  # [event, end, event, end, ..., incomplete rest]
        self._pending = parts[-1]
        return b"".join(self._event(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2))

    def finish(self) -> bytes:
        """Held-back bytes; after this, `billed()` is final."""
        if not self.stream:
            if self._copy is not None:
                try:
                    self.usage = _usage(json.loads(b"".join(self._copy)).get("usage"))
                except (ValueError, AttributeError):
                    pass
            out, self._pending = self._pending, b""
            return out
        rest, self._pending = self._pending, b""
        tail = self._event(rest, b"") if rest.strip() else rest
        return tail + self._done

    def billed(self) -> int:
        return self.billed_usage().total

    def billed_usage(self) -> Usage:
        """What this response is billed: the reported usage, else the estimate (see module doc)."""
        if self.status >= 400:
            return Usage(0, 0)  # the upstream refused: nothing was generated
        if self.usage is not None:
            return self.usage
        if self.stream:
            return Usage(self.prompt_estimate, self.content_chunks) if self.content_chunks else Usage(0, 0)
        return Usage(self.prompt_estimate, max(0, self.reserved - self.prompt_estimate))  # no usage: the reservation

    def _event(self, event: bytes, end: bytes) -> bytes:
        data = event.strip()
        if data == b"data: [DONE]":
            self._done = event + end
            return b""
        if data.startswith(b"data: {"):
            try:
                chunk = json.loads(data[len(b"data: "):])
            except ValueError:
                return event + end
            choices = chunk.get("choices") if isinstance(chunk, dict) else None
            if isinstance(choices, list) and any(_has_content(c) for c in choices):
                self.content_chunks += 1
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
            usage = _usage(chunk.get("usage")) if isinstance(chunk, dict) else None
            if usage is not None:
                self.usage = usage
                if self.strip_usage:
                    if not choices:
                        return b""  # the usage-only chunk the client did not ask for
                    return b"data: " + json.dumps({**chunk, "usage": None}).encode() + end
        return event + end


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(choice.get("text")) or (isinstance(delta, dict) and bool(delta.get("content")))
