"""A stream's repeating event bytes, so the meter can read most events without parsing them.

Within one streamed answer, vLLM's events for one sequence differ only in the generated text
and the usage counts: `data: {"id":...,"choices":[{"index":0,"delta":{"content":"` + text +
`"},...,"finish_reason":null}],"usage":` + usage + `}` (`"text":"` on /v1/completions). Once
the meter has parsed one such event in full, `EventShape` keeps the bytes before the text
(`head`) and between the text and the usage (`middle`). A later event that is `head`, one JSON
string, `middle`, one JSON object and the closing brace is the parsed one with that string and
that usage replaced: its choices, index and finish reason are the parsed one's, and its usage
is the object at the end (the top-level `usage`, since the brace after it closes the whole
event). Anything else (another field changed, a finish reason set, several choices, an unusual
escape) does not fit and is parsed in full.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

# The text's key (chat's delta content, or a completion's text) and the opening quote of its value.
_TEXT = re.compile(rb'"(?:content|text)"\s*:\s*"')
# The top-level usage member, last in the event: the comma before it, the key, the colon.
_USAGE_MEMBER = re.compile(rb',\s*"usage"\s*:\s*')
_BACKSLASH = 0x5C


@dataclass(frozen=True)
class EventShape:
    head: bytes  # up to and including the opening quote of the generated text
    middle: bytes  # from the text's closing quote to the usage value
    kept: int  # bytes of `middle` before its `,"usage":`, what a client that asked for no usage gets
    index: int  # the choice's index (which sequence)
    finished: bool  # whether the choice has a finish reason


def learn(event: bytes, chunk: dict[str, Any], index: int, finished: bool) -> EventShape | None:
    """The shape of `event` (`data: ` and its JSON, nothing around it), parsed as `chunk`;
    None when it has no single text-then-usage layout to reuse."""
    if (
        not event.startswith(b"data: {")
        or not event.endswith(b"}")
        or event.count(b'"usage"') != 1
        or event.count(b'"content"') + event.count(b'"text"') != 1
        or not isinstance(chunk.get("usage"), dict)
    ):
        return None
    text = _TEXT.search(event)
    if text is None:
        return None
    close = _string_end(event, text.end())
    usage = None if close < 0 else _USAGE_MEMBER.search(event, close)
    if usage is None or _object(event[usage.end() : -1]) != chunk["usage"]:  # the very usage the parse read
        return None
    return EventShape(
        head=event[: text.end()],
        middle=event[close : usage.end()],
        kept=usage.start() - close,
        index=index,
        finished=finished,
    )


def read(shape: EventShape, event: bytes) -> tuple[int, int, bytes] | None:
    """(prompt tokens, completion tokens, the event without its usage member) if `event` fits
    `shape`; None otherwise. A tuple, not an object: this runs for nearly every event."""
    if not event.startswith(shape.head) or not event.endswith(b"}"):
        return None
    start = len(shape.head)
    close = _string_end(event, start)
    if close < 0 or not event.startswith(shape.middle, close):
        return None
    try:
        orjson.loads(event[start - 1 : close + 1])  # a valid JSON string, as a parse would have required
        usage = orjson.loads(event[close + len(shape.middle) : -1])
    except orjson.JSONDecodeError:
        return None
    if type(usage) is not dict:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int:  # a float may be an integer past 64 bits
        return None
    return prompt, completion, event[: close + shape.kept] + b"}"


def _object(data: bytes) -> dict[str, Any] | None:
    """`data` as a JSON object, else None."""
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _string_end(data: bytes, start: int) -> int:
    """The index of the quote closing the JSON string whose text begins at `start`; -1 if none."""
    quote = data.find(b'"', start)
    while quote >= 0:
        before = quote
        while data[before - 1] == _BACKSLASH:
            before -= 1
        if (quote - before) % 2 == 0:  # an even run of backslashes escapes only itself
            return quote
        quote = data.find(b'"', quote + 1)
    return -1
