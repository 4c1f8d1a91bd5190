"""What the gateway remembers of a stream while relaying it, so that it can continue it.

`StreamRecorder.record(chunk)` is called with every JSON event the client is about to get, in
the client's coordinates (after any splice: serving.gateway.resume.splice), so a continuation
that is itself cut resumes from everything the client has. `snapshot()` freezes it into a
`StreamState`, the only input the continuation builder reads.

Per choice (`choices[].index`, which for /v1/completions with prompt lists is
`prompt * n + sequence`): the text released to the client, the generated token ids (vLLM's
`token_ids` of each chunk, present when the upstream body asked for `return_token_ids`), the
prompt's token ids (chat: the chunk's `prompt_token_ids`; completions: the choice's), how many
output tokens it has (the larger of the per-chunk usage count and the token ids seen: never
fewer than were generated), its finish reason, and the next completions logprob `text_offset`
(vLLM numbers a choice's offsets in characters from its first token, advancing by each reported
token's length: `completion/serving.py`, `completion_stream_generator`).

A choice's token state is exact only if every chunk that carried generated text also carried
its token ids; one that did not makes the token ids unknown (None), and the choice can only be
continued from its text.

The seam. vLLM's detokenizer (tokenizers' `DecodeStream`) holds back tokens that end inside a
UTF-8 character, streaming their ids with no text, and a `DecodeStream` primed with a prompt
that ends inside a character returns the whole prompt's text at its next step (tokenizers 0.23,
seen on the tiny model): a continuation cut there would send the client the prompt. So the
recorder keeps `clean_tokens`, how many of the ids end where the client's text ends on a whole
character: after a chunk of one token with text (its step released everything held), not after a
chunk of no text (held), and unknown (None) after a chunk of several tokens with text (vLLM merges
the deltas of a slow reader; whether its last token was held cannot be told from outside).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class ChoiceProgress:
    """One choice of the answer as far as the client has it."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] | None = ()  # None: some generated text came without its ids
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_tokens: int | None = None  # the choice's prompt, as the upstream counted it
    output_tokens: int = 0
    clean_tokens: int | None = 0  # ids up to the last whole character of the text (module docstring)
    clean_logprob_offset: int = 0  # the next `text_offset` at that point
    finish_reason: str | None = None
    logprob_offset: int = 0  # the next completions `text_offset`
    role_sent: bool = False  # chat: the `role` delta went out for this index
    tool_calls_seen: bool = False  # chat: a tool call was streamed (its parser state is lost at a cut)
    reasoning_seen: bool = False  # chat: reasoning was streamed (idem)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StreamState:
    """The whole stream as far as the client has it: what a continuation is built from."""

    path: str
    id: str | None = None
    created: int | None = None
    model: str | None = None
    choices: tuple[ChoiceProgress, ...] = ()
    final_usage_seen: bool = False
    error_event_seen: bool = False

    def choice(self, index: int) -> ChoiceProgress:
        for progress in self.choices:
            if progress.index == index:
                return progress
        return ChoiceProgress(index=index)

    def prompt_tokens(self, *, n: int) -> int:
        """The original prompts' tokens, each prompt once (its choices share it)."""
        by_prompt: dict[int, int] = {}
        for progress in self.choices:
            counted = progress.prompt_tokens
            if counted is None and progress.prompt_token_ids is not None:
                counted = len(progress.prompt_token_ids)
            if counted is not None:
                prompt = progress.index // n
                by_prompt[prompt] = max(by_prompt.get(prompt, 0), counted)
        return sum(by_prompt.values())

    def output_tokens(self) -> int:
        return sum(progress.output_tokens for progress in self.choices)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _token_ids(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(_int(item) is not None for item in value):
        return tuple(value)
    return None


@dataclass(slots=True)
class _ChoiceLog:
    """One choice as it is recorded: appended to per event (a frozen copy per event, or a tuple
    grown by concatenation, would cost time quadratic in the answer's length)."""

    index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] | None = field(default_factory=list)
    prompt_token_ids: tuple[int, ...] | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    clean_tokens: int | None = 0
    clean_logprob_offset: int = 0
    finish_reason: str | None = None
    logprob_offset: int = 0
    role_sent: bool = False
    tool_calls_seen: bool = False
    reasoning_seen: bool = False

    def progress(self) -> ChoiceProgress:
        return ChoiceProgress(
            index=self.index,
            text="".join(self.texts),
            token_ids=None if self.token_ids is None else tuple(self.token_ids),
            prompt_token_ids=self.prompt_token_ids,
            prompt_tokens=self.prompt_tokens,
            output_tokens=self.output_tokens,
            clean_tokens=self.clean_tokens,
            clean_logprob_offset=self.clean_logprob_offset,
            finish_reason=self.finish_reason,
            logprob_offset=self.logprob_offset,
            role_sent=self.role_sent,
            tool_calls_seen=self.tool_calls_seen,
            reasoning_seen=self.reasoning_seen,
        )

    def add(
        self, choice: dict[str, Any], path: str, shared_prompt: tuple[int, ...] | None, usage: dict[str, Any] | None
    ) -> None:
        """One chunk's `choice` (and the chunk's usage when it is this choice's)."""
        if path == CHAT:
            raw_delta = choice.get("delta")
            delta: dict[str, Any] = raw_delta if isinstance(raw_delta, dict) else {}
            self.role_sent = self.role_sent or delta.get("role") is not None
            content = delta.get("content")
            text = content if isinstance(content, str) else ""
            self.tool_calls_seen = self.tool_calls_seen or bool(delta.get("tool_calls") or delta.get("function_call"))
            self.reasoning_seen = self.reasoning_seen or bool(delta.get("reasoning") or delta.get("reasoning_content"))
            prompt_ids = shared_prompt
        else:
            completion_text = choice.get("text")
            text = completion_text if isinstance(completion_text, str) else ""
            prompt_ids = _token_ids(choice.get("prompt_token_ids"))
        if text:
            self.texts.append(text)
        if prompt_ids is not None:
            self.prompt_token_ids = prompt_ids
        self.logprob_offset = _next_offset(self.logprob_offset, choice.get("logprobs"))
        self._add_ids(_token_ids(choice.get("token_ids")), text)
        if usage is not None:
            self.output_tokens = max(self.output_tokens, _int(usage.get("completion_tokens")) or 0)
            counted = _int(usage.get("prompt_tokens"))
            self.prompt_tokens = counted if counted is not None else self.prompt_tokens
        finish = choice.get("finish_reason")
        if isinstance(finish, str):
            self.finish_reason = finish

    def _add_ids(self, new_ids: tuple[int, ...] | None, text: str) -> None:
        if self.token_ids is None:
            return
        if new_ids is None:
            if text or self.tool_calls_seen or self.reasoning_seen:  # generated something whose ids we were not told
                self.token_ids = None
            return
        self.token_ids.extend(new_ids)
        self.output_tokens = max(self.output_tokens, len(self.token_ids))
        if text and len(new_ids) == 1:  # that step released everything held: a whole character
            self.clean_tokens, self.clean_logprob_offset = len(self.token_ids), self.logprob_offset
        elif text:
            self.clean_tokens = None


@dataclass
class StreamRecorder:
    """Builds a `StreamState` from the chunks relayed to the client (module docstring)."""

    path: str
    _state: StreamState = field(init=False)
    _choices: dict[int, _ChoiceLog] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._state = StreamState(path=self.path)

    def record(self, chunk: dict[str, Any]) -> None:
        if isinstance(chunk.get("error"), dict) or chunk.get("object") == "error":
            self._state = replace(self._state, error_event_seen=True)
            return
        if self._state.id is None or self._state.created is None or self._state.model is None:
            self._note_response(chunk)
        choices = chunk.get("choices")
        choices = [c for c in choices if isinstance(c, dict)] if isinstance(choices, list) else []
        usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
        if not choices:
            if usage is not None:
                self._state = replace(self._state, final_usage_seen=True)
            return
        shared_prompt = _token_ids(chunk.get("prompt_token_ids"))  # chat: the response's, on its first chunks
        for choice in choices:
            index = _int(choice.get("index"))
            if index is None or index < 0:
                continue
            log = self._choices.get(index)
            if log is None:
                log = self._choices[index] = _ChoiceLog(index)
            # vLLM's per-chunk usage counts one sequence: only a chunk of one choice says whose.
            log.add(choice, self.path, shared_prompt, usage if len(choices) == 1 else None)

    def snapshot(self) -> StreamState:
        ordered = tuple(self._choices[index].progress() for index in sorted(self._choices))
        return replace(self._state, choices=ordered)

    def _note_response(self, chunk: dict[str, Any]) -> None:
        """The response's id, created and model, from its first chunk that names them."""
        state, ident, created, model = self._state, chunk.get("id"), _int(chunk.get("created")), chunk.get("model")
        self._state = replace(
            state,
            id=state.id if state.id is not None or not isinstance(ident, str) else ident,
            created=state.created if state.created is not None else created,
            model=state.model if state.model is not None or not isinstance(model, str) else model,
        )


def _next_offset(offset: int, logprobs: Any) -> int:
    """vLLM's next `text_offset` after a completions chunk's logprobs: the last offset plus the
    last token's length (chat logprobs carry no offsets)."""
    if not isinstance(logprobs, dict):
        return offset
    offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
    if (
        isinstance(offsets, list)
        and offsets
        and isinstance(tokens, list)
        and tokens
        and _int(offsets[-1]) is not None
        and isinstance(tokens[-1], str)
    ):
        return int(offsets[-1]) + len(tokens[-1])
    return offset


def with_token_ids(document: dict[str, Any]) -> dict[str, Any]:
    """The upstream body of a stream that may be resumed: vLLM reports each chunk's generated
    token ids and the prompt's (`return_token_ids`, a vLLM extension Ray Serve LLM passes on: its
    ingress parses bodies with vLLM's own request classes), which an exact continuation needs."""
    return {**document, "return_token_ids": True}


def client_view(chunk: dict[str, Any], *, client_asked_token_ids: bool) -> dict[str, Any]:
    """`chunk` as the client gets it: the token ids the gateway asked for only if the client did."""
    if client_asked_token_ids:
        return chunk
    view = {k: v for k, v in chunk.items() if k != "prompt_token_ids"}
    choices = chunk.get("choices")
    if isinstance(choices, list):
        view["choices"] = [
            {k: v for k, v in c.items() if k not in ("token_ids", "prompt_token_ids")} if isinstance(c, dict) else c
            for c in choices
        ]
    return view
