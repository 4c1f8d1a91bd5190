"""The request that continues an interrupted answer, built from the body the gateway checked
and what the client already has (serving.gateway.resume.state).

Each unfinished choice continues on its own (n = 1): with `n` > 1 or a prompt list, the choices
of one answer were independent sequences anyway. A choice continues in one of three ways:

- `tokens` (exact): a /v1/completions request whose prompt is the prompt's token ids followed by
  the ids generated so far, for chat and completions alike (vLLM takes prompts as token ids;
  its detokenizer is primed with the prompt, so the first new token decodes in context). The
  engine sees exactly the sequence it had, so a greedy answer continues as if never cut. Chat
  chunks are rebuilt from it by the splice. The ids go up to the last whole character of the
  client's text (`clean_tokens`, serving.gateway.resume.state): the ids after it, which the
  client got no text for, are generated again (`replayed`; their ids are not sent twice and
  their tokens not billed twice). Used when the upstream reported every generated
  token's id and the prompt's, and nothing the completions route cannot carry matters: no chat
  logprobs (their format differs), no tools (their parser runs only on chat), no media (token
  ids of a media prompt hold placeholders, not the media), no stop string whose text vLLM held
  back (the client has less text than the ids say, and the held-back part would be lost).
- `text`: the same route again, the text the client has appended. Chat uses vLLM's
  `continue_final_message` with no generation prompt (the partial answer as the open last
  assistant message); completions append it to the prompt. The text is re-tokenised, so the
  seam may differ from the uninterrupted answer by a token: the fallback.
- `restart`: a choice the client got nothing of is sent again as it was (n = 1): exact.

A choice that already generated its whole limit has finished (`Exhausted`); the splice sends its
`length` finish. Some answers cannot be continued at all (`NotResumable`): a tool call or
reasoning already streamed (their parser's state is lost), structured output (its grammar would
restart at the seam), embeddings as prompts, `suffix`, chat `echo`.

Budget. The limit per sequence is the gateway's own output bound (serving.gateway.metering.output_bound,
including a max_tokens the gateway added), and a continuation asks for that minus what the choice
already has (less the replayed tokens, which it generates again), so an answer can never get more
output than the original request allowed;
`min_tokens` shrinks alike. Sampling settings, `stop`, `seed`, tools and every extension the stack
allowed are carried over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from serving.gateway.metering.output_bound import OutputBound
from serving.gateway.resume.state import CHAT, COMPLETIONS, ChoiceProgress, StreamState

Mode = Literal["tokens", "text", "restart"]
STREAM_OPTIONS = {"include_usage": True, "continuous_usage_stats": True}
# Chat fields that mean the same to /v1/completions (OpenAI's, then vLLM's sampling extensions).
CARRIED_TO_COMPLETIONS = frozenset(
    {
        "temperature",
        "top_p",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "seed",
        "stop",
        "user",
        "top_k",
        "min_p",
        "repetition_penalty",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "min_tokens",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "allowed_token_ids",
        "bad_words",
        "priority",
    }
)
# Chat fields already inside the prompt's token ids (rendered by the template) or that vLLM does
# not act on: a chat with only these and the carried ones may continue on its token ids.
RENDERED_OR_IGNORED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "stream",
        "stream_options",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "add_special_tokens",
        "reasoning_effort",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "safety_identifier",
        "verbosity",
        "modalities",
        "return_token_ids",
        "request_id",
        "parallel_tool_calls",
        "tool_choice",
        "tools",
        "logprobs",
        "top_logprobs",
        "response_format",
    }
)
STRUCTURED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class Continuation:
    """The request continuing choice `index`: sent to `path` with `body`; `before` output tokens
    of the choice are already the client's, and the continuation starts by generating the
    `replayed` ones after them again."""

    index: int
    path: str
    body: dict[str, Any]
    mode: Mode
    before: int
    replayed: int = 0  # the choice's last ids, which the client got no text for: generated again


@dataclass(frozen=True)
class Exhausted:
    """Choice `index` generated its whole limit: it finished (`length`), only its end was lost."""

    index: int


@dataclass(frozen=True)
class NotResumable:
    index: int | None  # None: the request as a whole
    reason: str


Step = Continuation | Exhausted


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _prompts(document: dict[str, Any]) -> list[Any]:
    """/v1/completions' prompts as vLLM splits them: a string or one token-id list is one."""
    prompt = document.get("prompt")
    if isinstance(prompt, list) and prompt and not all(_int(item) is not None for item in prompt):
        return list(prompt)
    return [prompt]


def holds_back_stop_text(document: dict[str, Any]) -> bool:
    """vLLM holds back the last `len(longest stop) - 1` characters of the text it streams while a
    stop string may still complete (v1/engine/detokenizer.py, `stop_buffer_length`)."""
    if document.get("include_stop_str_in_output") is True:
        return False
    stop = document.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    return any(isinstance(s, str) and len(s) > 1 for s in stops)


def _has_media(document: dict[str, Any]) -> bool:
    for message in document.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(not (isinstance(p, dict) and p.get("type") == "text") for p in content):
            return True
    return False


def _structured(document: dict[str, Any]) -> bool:
    response_format = document.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    return kind not in (None, "text") or any(document.get(name) is not None for name in STRUCTURED)


def _request_refusal(document: dict[str, Any], path: str) -> NotResumable | None:
    if _structured(document):
        return NotResumable(None, "structured output cannot be continued: its grammar would restart")
    if document.get("prompt_embeds") is not None or document.get("mm_payload") is not None:
        return NotResumable(None, "prompts given as embeddings or media cannot be continued")
    if path == COMPLETIONS and document.get("suffix") is not None:
        return NotResumable(None, "completions with a suffix cannot be continued")
    if path == CHAT and document.get("echo"):
        return NotResumable(None, "chat echo cannot be continued")
    return None


def _chat_tokens_fit(document: dict[str, Any]) -> bool:
    """A chat that may continue as a completion of its token ids (module docstring)."""
    if any(name not in RENDERED_OR_IGNORED | CARRIED_TO_COMPLETIONS for name in document):
        return False  # an extension /v1/completions may not carry: continue as chat, which carries everything
    uses_tools = bool(document.get("tools")) and document.get("tool_choice") != "none"
    return not (uses_tools or document.get("functions") or document.get("logprobs") or _has_media(document))


def _streamed(body: dict[str, Any], *, max_tokens_key: str, remaining: int, before: int) -> dict[str, Any]:
    """`body` as a one-sequence stream of at most `remaining` tokens, usage in every chunk, token ids on."""
    min_tokens = _int(body.get("min_tokens"))
    body = {k: v for k, v in body.items() if k not in ("max_tokens", "max_completion_tokens")}
    body.update(
        {
            max_tokens_key: remaining,
            "n": 1,
            "stream": True,
            "stream_options": dict(STREAM_OPTIONS),
            "return_token_ids": True,
        }
    )
    if min_tokens is not None:
        # Never above what the continuation may generate: vLLM refuses min_tokens > max_tokens, and
        # usage can report more output than the token ids the seam counts (`before`).
        body["min_tokens"] = min(max(0, min_tokens - before), remaining)
    return body


def _tokens_body(
    document: dict[str, Any], path: str, progress: ChoiceProgress, clean: int, remaining: int
) -> dict[str, Any]:
    assert progress.prompt_token_ids is not None and progress.token_ids is not None
    if path == CHAT:
        base = {k: v for k, v in document.items() if k in CARRIED_TO_COMPLETIONS}
        base["model"] = document.get("model")
    else:  # the whole body: its extensions mean the same; the prompt is re-sent as it was read
        base = {k: v for k, v in document.items() if k not in ("truncate_prompt_tokens", "echo")}
    base["prompt"] = [*progress.prompt_token_ids, *progress.token_ids[:clean]]
    return _streamed(base, max_tokens_key="max_tokens", remaining=remaining, before=clean)


def _text_body(
    document: dict[str, Any], path: str, progress: ChoiceProgress, remaining: int, n: int
) -> dict[str, Any] | None:
    if path == CHAT:
        messages = list(document.get("messages") or [])
        last = messages[-1] if messages and isinstance(messages[-1], dict) else None
        if (
            document.get("continue_final_message")
            and last is not None
            and last.get("role") == "assistant"
            and isinstance(last.get("content"), str)
        ):
            messages[-1] = {**last, "content": last["content"] + progress.text}  # the caller's own prefill, extended
        else:
            messages.append({"role": "assistant", "content": progress.text})
        body = {**document, "messages": messages, "continue_final_message": True, "add_generation_prompt": False}
        return _streamed(
            body, max_tokens_key="max_completion_tokens", remaining=remaining, before=progress.output_tokens
        )
    prompt = _prompts(document)[progress.index // n]
    if not isinstance(prompt, str) or document.get("echo"):
        return None  # the text cannot be appended to token ids, nor told apart from an echoed prompt
    body = {**document, "prompt": prompt + progress.text, "echo": False}
    return _streamed(body, max_tokens_key="max_tokens", remaining=remaining, before=progress.output_tokens)


def _restart_body(document: dict[str, Any], path: str, index: int, n: int, limit: int) -> dict[str, Any]:
    body = dict(document)
    if path == COMPLETIONS:
        body["prompt"] = _prompts(document)[index // n]
    key = "max_completion_tokens" if path == CHAT else "max_tokens"
    return _streamed(body, max_tokens_key=key, remaining=limit, before=0)


def _step(document: dict[str, Any], path: str, progress: ChoiceProgress, bound: OutputBound) -> Step | NotResumable:
    index, limit = progress.index, bound.per_sequence
    if progress.tool_calls_seen or progress.reasoning_seen:
        return NotResumable(index, "a streamed tool call or reasoning cannot be continued")
    remaining = limit - progress.output_tokens
    if remaining <= 0:
        return Exhausted(index)
    nothing_yet = progress.output_tokens == 0 and not progress.text and not progress.token_ids
    if nothing_yet:
        return Continuation(index, path, _restart_body(document, path, index, bound.sequences, limit), "restart", 0)
    clean = progress.clean_tokens
    exact = (
        progress.token_ids is not None
        and progress.prompt_token_ids is not None
        and clean is not None
        and not holds_back_stop_text(document)
        and (path == COMPLETIONS or _chat_tokens_fit(document))
    )
    if exact:
        assert progress.token_ids is not None and clean is not None
        replayed = len(progress.token_ids) - clean
        before = progress.output_tokens - replayed
        body = _tokens_body(document, path, progress, clean, limit - before)
        return Continuation(index, COMPLETIONS, body, "tokens", before, replayed)
    text_body = _text_body(document, path, progress, remaining, bound.sequences)
    if text_body is None:
        return NotResumable(index, "the answer's token ids are unknown and its prompt is not text")
    return Continuation(index, path, text_body, "text", progress.output_tokens)


def continuations(
    document: dict[str, Any], path: str, state: StreamState, bound: OutputBound
) -> list[Step] | NotResumable:
    """One step per unfinished choice of the answer (`bound`: the request's output bound, whose
    `prompts` x `sequences` are its choices), or why the answer cannot be continued."""
    refusal = _request_refusal(document, path)
    if refusal is not None:
        return refusal
    steps: list[Step] = []
    for index in range(bound.prompts * bound.sequences):
        progress = state.choice(index)
        if progress.finished:
            continue
        step = _step(document, path, progress, bound)
        if isinstance(step, NotResumable):
            return step
        steps.append(step)
    return steps
