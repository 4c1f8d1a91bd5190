"""Token accounting that needs no Redis (pure code): what a response is billed. What a request
reserves is `serving.gateway.metering.reservation`; the rate-limit headers are the limiter's
(serving.gateway.limits.decision).

Billing. `UsageMeter` watches the relayed bytes. A JSON body's `usage` object is found as the
bytes pass (no copy of the body is kept, whatever its size). A stream is asked for usage in
every chunk (`stream_options.include_usage` and vLLM's `continuous_usage_stats`), so the meter
always holds the upstream's latest count; the chunks' usage the client did not ask for is
stripped on the way back. What is billed, in order:

- the upstream refused (status >= 400), or was never reached: nothing;
- the upstream timed out before answering (504: it had the request, and vLLM generates a whole
  non-streamed answer before sending a byte): the reservation;
- the upstream's final usage (a JSON body's, or a stream's last chunk): that;
- a stream that ended without a final count: the last usage seen, per sequence (vLLM counts
  each sequence's tokens in its own chunks); a stream cut after every sequence had finished
  (each one's finish reason seen): the same, since the engine generates nothing more for them;
- anything else - no usage seen at all, or a stream cut while a sequence was still running: the
  reservation (with the prompt's exact count once every prompt's was seen). The engine keeps
  generating until the cut reaches it, through Ray Serve, at its own pace and ahead of what
  reached the gateway (queued in Ray's streaming generator, in socket buffers, or behind a
  client that stopped reading); no count the gateway saw says how far it got.

An `error` event inside a 200 stream is replaced by the gateway's own (serving.gateway.protocol.upstream_errors);
the stream is billed by the rules above.

Counting chunks would under-bill: one chunk may carry several tokens (speculative decoding,
vLLM's `stream_interval`), so output is only ever counted from reported usage.

Every streamed event is read (its usage may be the last one seen when the stream is cut), so
the per-event path is the gateway's per-token cost. An event is parsed and re-serialized with
orjson, and with the standard library where orjson refuses what it accepts (lone surrogate
escapes, numbers beyond a double) or reads a usage count differently (integers past 64 bits).
Once the stream's first text has been parsed, an event that repeats the last parsed one's bytes
but for its text and usage is read without a full parse (`serving.gateway.protocol.event_shape`), with
the same result; anything else is parsed in full.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from serving.gateway.metering.reservation import COMPLETION_PATHS, Reservation
from serving.gateway.protocol import event_shape, upstream_errors

_EVENT_END = re.compile(rb"(\r?\n\r?\n)")  # SSE events end with a blank line (LF or CRLF)
# Sequences whose event bytes are kept (serving.gateway.protocol.event_shape): each event is tried
# against each, so a stream of many sequences (n, prompt lists) keeps a few and parses the rest.
_SHAPES_KEPT = 4


def wants_stream(document: dict[str, Any] | None, path: str) -> bool:
    return document is not None and path in COMPLETION_PATHS and document.get("stream") is True


def request_usage_upstream(document: dict[str, Any]) -> dict[str, Any]:
    """The body to send upstream: usage in every chunk and at the end (vLLM sends per-chunk usage
    only with include_usage: serve/utils/api_utils.py `should_include_usage`, vLLM 0.32)."""
    options = document.get("stream_options")
    options = dict(options) if isinstance(options, dict) else {}
    options.update(include_usage=True, continuous_usage_stats=True)
    return {**document, "stream_options": options}


def client_usage_wishes(document: dict[str, Any]) -> tuple[bool, bool]:
    """(the client asked for the final usage chunk, the client asked for usage in every chunk)."""
    options = document.get("stream_options")
    options = options if isinstance(options, dict) else {}
    final = options.get("include_usage") is True
    return final, final and options.get("continuous_usage_stats") is True


@dataclass(frozen=True)
class Usage:
    prompt: int
    completion: int
    # A resumed stream's re-done work (serving.gateway.upstream.resuming_relay): the prompt and answer
    # so far prefilled again, and tokens generated again at the seam. The platform's cost, recorded
    # in the usage ledger as overhead, never billed: `total` leaves it out.
    overhead_prompt: int = 0
    overhead_completion: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.completion


NOTHING_BILLED = Usage(0, 0)  # the request ended before anything was generated


def _usage(usage: Any) -> Usage | None:
    """OpenAI's `usage` object as numbers; None when it carries none."""
    counts = _counts(usage)
    return None if counts is None else Usage(*counts)


def _counts(usage: Any) -> tuple[int, int] | None:
    """OpenAI's `usage` object as (prompt, completion); None when it carries none. A total
    without parts (seen from some servers) is counted as prompt. A plain tuple: this runs for
    every streamed event."""
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) else None
    completion = completion if isinstance(completion, int) else None
    if prompt is None and completion is None:
        total = usage.get("total_tokens")
        return (total, 0) if isinstance(total, int) else None
    return prompt or 0, completion or 0


# A real `usage` key of a JSON document: in valid JSON, a `"` inside a string is always escaped,
# so `{` or `,` then an unescaped `"usage"` can only be a key. The upstream's responses have
# exactly one, at the top level, after the choices (whose text the model controls).
_USAGE_KEY = re.compile(rb'[{,]\s*"usage"\s*:\s*')
_KEY_OVERLAP = 64  # bytes kept from the previous chunk, so a key split across chunks is still found
_USAGE_MAX_BYTES = 65_536  # a usage object is a few numbers; past this it is not one
_JSON = json.JSONDecoder()


class _UsageScanner:
    """Finds a JSON body's `usage` object in bytes passing through, keeping only a few of them."""

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self._tail = b""
        self._capture: bytearray | None = None
        self._done = False

    def feed(self, chunk: bytes) -> None:
        if self._done:
            return
        if self._capture is None:
            window = self._tail + chunk
            found = _USAGE_KEY.search(window)
            if found is None:
                self._tail = window[-_KEY_OVERLAP:]
                return
            self._capture = bytearray(window[found.end() :])
        else:
            self._capture += chunk
        self._try_decode()

    def _try_decode(self) -> None:
        assert self._capture is not None
        try:
            value, _ = _JSON.raw_decode(self._capture.decode("utf-8", "replace"))
        except ValueError:
            if len(self._capture) > _USAGE_MAX_BYTES:
                self._done = True
            return
        self.usage, self._done = _usage(value), True


class UsageMeter:
    """Watches one relayed response body and says what to bill (rules in the module docstring).

    `feed(chunk)` returns the bytes to send to the client now; `finish()`, called when the
    upstream ended its response, the bytes held back to the very end (the JSON body's last
    chunk, or a stream's `data: [DONE]`), which the relay sends only after settlement, so a
    client that has the whole answer also sees its refund.
    """

    def __init__(
        self,
        *,
        stream: bool,
        reservation: Reservation,
        client_final_usage: bool = True,
        client_continuous_usage: bool = True,
        client_chunk: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    ) -> None:
        self.stream, self.reservation = stream, reservation
        # A resumable stream's hook (serving.gateway.resume.request): every event is parsed and
        # handed to it (it records what the client gets, and may trim it), so no event is read
        # by its shape alone.
        self._client_chunk = client_chunk
        self.strip_final, self.strip_continuous = not client_final_usage, not client_continuous_usage
        self.status = 200
        self.usage: Usage | None = None  # the upstream's final count
        self._overhead = (0, 0)  # a resumed stream's re-done (prompt, completion) tokens: not billed
        self.finished = False
        self._worked_unanswered = False
        self.first_token_at: float | None = None  # time.perf_counter() of the first generated text
        self._completion_by_sequence: dict[int, int] = {}
        self._finished_sequences: set[int] = set()
        self._prompt_by_prompt: dict[int, int] = {}
        self._aggregate: Usage | None = None  # per-chunk usage of chunks with several sequences
        self._pending = b""
        self._done = b""  # a stream's `data: [DONE]`, held back until settlement
        self._scanner = _UsageScanner()
        self._shapes: dict[int, event_shape.EventShape] = {}  # per sequence, the bytes its events repeat

    def feed(self, chunk: bytes) -> bytes:
        if not self.stream:
            self._scanner.feed(chunk)
            out, self._pending = self._pending, chunk
            return out
        buffer = self._pending + chunk
        if b"\r" not in buffer:  # LF-only events (what vLLM sends): bytes.split, far cheaper than the regex
            *events, self._pending = buffer.split(b"\n\n")
            if len(events) == 1:  # the usual case: one token, one event, one chunk
                return self._event(events[0], b"\n\n")
            return b"".join([self._event(event, b"\n\n") for event in events])
        parts = _EVENT_END.split(buffer)  # [event, end, event, end, ..., incomplete rest]
        self._pending = parts[-1]
        return b"".join([self._event(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)])

    def finish(self) -> bytes:
        """Held-back bytes; the upstream ended its response, so `billed()` is final."""
        self.finished = True
        if not self.stream:
            self.usage = self._scanner.usage
            out, self._pending = self._pending, b""
            return out
        rest, self._pending = self._pending, b""
        tail = self._event(rest, b"") if rest.strip() else rest
        return tail + self._done

    @property
    def done_seen(self) -> bool:
        """The stream's end marker (`data: [DONE]`) came, and is held back."""
        return bool(self._done)

    def no_answer(self, status: int) -> None:
        """The upstream never answered; `status` is the gateway's own error. Only a timeout
        (504) means the upstream had the request and may have been working on it."""
        self.status = status
        self._worked_unanswered = status == 504

    def billed(self) -> int:
        return self.billed_usage().total

    def add_overhead(self, prompt: int, completion: int) -> None:
        """Count a continuation's re-done work (`Usage.overhead_*`): settled with the bill, never in it."""
        self._overhead = (self._overhead[0] + prompt, self._overhead[1] + completion)

    def billed_usage(self) -> Usage:
        billed = self._billed_usage()
        if self._overhead == (0, 0):
            return billed
        return replace(billed, overhead_prompt=self._overhead[0], overhead_completion=self._overhead[1])

    def _billed_usage(self) -> Usage:
        if self._worked_unanswered:
            return self._reserved()
        if self.status >= 400:
            return Usage(0, 0)  # refused, or never reached the upstream: nothing was generated
        final = self.usage if self.stream else self._scanner.usage  # a body's usage counts even if its end was cut
        if final is not None:
            return final
        seen = self._seen()
        sequences = self.reservation.prompts * self.reservation.n
        if self.stream and seen is not None and (self.finished or len(self._finished_sequences) == sequences):
            return seen
        return self._reserved()

    def _seen(self) -> Usage | None:
        """The latest per-chunk usage, summed over sequences and prompts; None if none came."""
        if not self._completion_by_sequence and self._aggregate is None:
            return None
        completion = sum(self._completion_by_sequence.values())
        if len(self._prompt_by_prompt) == self.reservation.prompts:
            prompt = sum(self._prompt_by_prompt.values())
        else:  # some prompts not heard of yet: they may have been read (prefilled) all the same
            prompt = self.reservation.prompt
        if self._aggregate is not None:
            prompt, completion = max(prompt, self._aggregate.prompt), max(completion, self._aggregate.completion)
        return Usage(prompt, completion)

    def _reserved(self) -> Usage:
        """The reservation; the prompt's exact count instead of its bound when it is known."""
        seen = self._seen()
        known_prompt = seen is not None and len(self._prompt_by_prompt) == self.reservation.prompts
        prompt = seen.prompt if seen is not None and known_prompt else self.reservation.prompt
        completion = max(self.reservation.output, seen.completion if seen is not None else 0)
        return Usage(prompt, completion)

    def _event(self, event: bytes, end: bytes) -> bytes:
        """One SSE event, as the client gets it. The per-event hot path: an event shaped like one
        already parsed is read here, in place; only the others are parsed (`_parsed`)."""
        for shape in self._shapes.values():
            shaped = event_shape.read(shape, event)
            if shaped is not None:
                prompt, completion, without_usage = shaped
                self._note_sequence(shape.index, shape.finished, prompt, completion)
                return (without_usage if self.strip_continuous else event) + end
        return self._parsed(event, end)

    def _parsed(self, event: bytes, end: bytes) -> bytes:
        data = event.strip()
        if data == b"data: [DONE]":
            self._done = event + end
            return b""
        if not data.startswith(b"data: {"):
            return event + end
        chunk, dumps = _parse_event(data[len(b"data: ") :])
        if not isinstance(chunk, dict):
            return event + end
        if upstream_errors.is_error_event(chunk):
            return self._error_event(chunk, data, end)
        if self._client_chunk is not None:
            viewed = self._client_chunk(chunk)
            if viewed is None:
                return b""
            chunk = viewed
            event = b"data: " + dumps(chunk)
        choices = chunk.get("choices")
        choices = choices if isinstance(choices, list) else []
        if self.first_token_at is None and any(_has_content(c) for c in choices):
            self.first_token_at = time.perf_counter()
        counts = _counts(chunk.get("usage"))
        if counts is None:
            return event + end
        if not choices:  # the final usage chunk: every sequence of every prompt
            self.usage = Usage(*counts)
            return b"" if self.strip_final else event + end
        sequence = self._note_sequence_usage(choices, *counts)
        # Once the first text is timed, what this event's bytes repeat is all later events need.
        if sequence is not None and self.first_token_at is not None and self._client_chunk is None:
            self._learn_shape(event, chunk, sequence)
        if not self.strip_continuous:
            return event + end
        del chunk["usage"]
        return b"data: " + dumps(chunk) + end

    def _error_event(self, chunk: dict[str, Any], data: bytes, end: bytes) -> bytes:
        """The gateway's own error event in place of the upstream's (whose text may name internal
        addresses and exceptions); nothing when a resumable stream holds it back to resume instead
        (serving.gateway.resume.request)."""
        if self._client_chunk is not None and self._client_chunk(chunk) is None:
            return b""
        return upstream_errors.stream_error_event(chunk, data) + end

    def _learn_shape(self, event: bytes, chunk: dict[str, Any], sequence: tuple[int, bool]) -> None:
        learned = event_shape.learn(event, chunk, *sequence)
        if learned is None:
            self._shapes.pop(sequence[0], None)
        elif learned.index in self._shapes or len(self._shapes) < _SHAPES_KEPT:
            self._shapes[learned.index] = learned

    def _note_sequence_usage(self, choices: list[Any], prompt: int, completion: int) -> tuple[int, bool] | None:
        """vLLM's per-chunk usage counts the prompt of the chunk's sequence and that sequence's
        own output so far (chat_completion/serving.py and completion/serving.py, vLLM 0.32).
        (the sequence's index, whether it finished); None when the chunk is not one sequence's."""
        choice = choices[0] if isinstance(choices[0], dict) else {}
        index, n = choice.get("index"), self.reservation.n
        if (
            len(choices) != 1
            or not isinstance(index, int)
            or isinstance(index, bool)
            or not 0 <= index < self.reservation.prompts * n
        ):
            prev = self._aggregate or Usage(0, 0)
            self._aggregate = Usage(max(prev.prompt, prompt), max(prev.completion, completion))
            return None
        finished = choice.get("finish_reason") is not None
        self._note_sequence(index, finished, prompt, completion)
        return index, finished

    def _note_sequence(self, index: int, finished: bool, prompt: int, completion: int) -> None:
        prompt_index = index // self.reservation.n
        before = self._completion_by_sequence.get(index, 0)
        self._completion_by_sequence[index] = max(before, completion)  # set even at 0: usage was seen
        if finished:
            self._finished_sequences.add(index)
        self._prompt_by_prompt[prompt_index] = max(self._prompt_by_prompt.get(prompt_index, 0), prompt)


def _stdlib_dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def _parse_event(data: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """An event's JSON value (None when it is not JSON) and the function that writes it back."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    else:
        usage = value.get("usage") if isinstance(value, dict) else None
        # orjson reads integers past 64 bits as floats, which `_usage` would not count.
        if not (isinstance(usage, dict) and float in map(type, usage.values())):
            return value, orjson.dumps
    try:
        return json.loads(data), _stdlib_dumps
    except ValueError:
        return None, _stdlib_dumps


def _has_content(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    return bool(choice.get("text")) or (isinstance(delta, dict) and bool(delta.get("content")))
