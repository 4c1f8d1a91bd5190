"""Make a continuation's stream read as the rest of the stream the client is reading.

`Splice.rewrite(chunk)` takes one JSON event of a continuation (serving.gateway.resume.continuation)
and returns the events the client gets instead, in the original stream's terms: its `id`,
`created`, `model` and `object`, the choice's original `index`, no second role chunk, a
completions logprob `text_offset` that goes on from where the cut left it, and chat chunks
rebuilt from the completion chunks of a chat continued on its token ids.

Usage. Each rewritten chunk carries the choice's usage as the uninterrupted stream would have:
the original prompt's tokens, and every output token of the choice (what it had before the cut
plus what the continuation generated). The continuation's own final usage chunk is dropped;
after the last continuation, `final_usage_chunk` (from the recorder's state, which saw the
rewritten chunks) is the one the client and the meter get: the tenant pays each prompt once and
each output token once. What the continuation's prompt cost the engine again (the re-done
prefill, the original prompt included) is `overhead_prompt_tokens`: the platform's, not billed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serving.gateway.resume.continuation import Continuation
from serving.gateway.resume.state import CHAT, COMPLETIONS, StreamState

CHUNK_OBJECT = {CHAT: "chat.completion.chunk", COMPLETIONS: "text_completion"}
ASSISTANT = "assistant"


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


@dataclass
class Splice:
    """Rewrites one continuation's events for the client (module docstring). `client_path`: the
    route the client called."""

    state: StreamState
    continuation: Continuation
    client_path: str
    generated: int = 0  # output tokens of the continuation itself
    continuation_prompt_tokens: int = 0
    _generated_ids: int = field(init=False, default=0)
    _role_sent: bool = field(init=False)

    def __post_init__(self) -> None:
        self._role_sent = self.state.choice(self.continuation.index).role_sent

    @property
    def overhead_output_tokens(self) -> int:
        """Output tokens generated twice (the replayed ones): the platform's, billed once."""
        return min(self.continuation.replayed, self.generated)

    @property
    def overhead_prompt_tokens(self) -> int:
        """Prompt tokens the continuation made the engine read again: at least the ids it sent."""
        prompt = self.continuation.body.get("prompt")
        sent = len(prompt) if self.continuation.mode == "tokens" and isinstance(prompt, list) else 0
        return max(self.continuation_prompt_tokens, sent)

    def _prompt_tokens(self) -> int:
        """The original prompt's tokens, as the uninterrupted stream reported them. Unknown only if
        the cut came before any usage: then the continuation's count, which holds the original
        prompt (more, never less: a prompt is not under-billed)."""
        progress = self.state.choice(self.continuation.index)
        if progress.prompt_tokens is not None:
            return progress.prompt_tokens
        if progress.prompt_token_ids is not None:
            return len(progress.prompt_token_ids)
        return self.continuation_prompt_tokens

    def rewrite(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if isinstance(chunk.get("error"), dict) or chunk.get("object") == "error":
            return [chunk]  # relayed as the gateway's own error event (serving.gateway.protocol.upstream_errors)
        usage = chunk.get("usage") if isinstance(chunk.get("usage"), dict) else None
        if usage is not None:
            self.continuation_prompt_tokens = max(self.continuation_prompt_tokens, _int(usage.get("prompt_tokens")))
            self.generated = max(self.generated, _int(usage.get("completion_tokens")))
        choices = [c for c in chunk.get("choices") or [] if isinstance(c, dict)]
        if not choices:
            return []  # the continuation's final usage: the whole stream's comes from final_usage_chunk
        out: list[dict[str, Any]] = []
        for choice in choices:
            token_ids = choice.get("token_ids")
            if isinstance(token_ids, list):
                # The replayed tokens went out before the cut: the client (and the recorder) has
                # their ids and logprobs; only their text, held back then, is new.
                skip = max(0, min(len(token_ids), self.continuation.replayed - self._generated_ids))
                self._generated_ids += len(token_ids)
                self.generated = max(self.generated, self._generated_ids)
                if skip:
                    choice = {**choice, "token_ids": token_ids[skip:], "logprobs": _after(choice.get("logprobs"), skip)}
                    if not choice["token_ids"] and not choice.get("text") and choice.get("finish_reason") is None:
                        continue  # nothing the client has not had
            rebuilt = self._choice(choice)
            if rebuilt is None:
                continue
            if self.client_path == CHAT and not self._role_sent:  # a chat rebuilt from completion chunks
                out.append(
                    self._chunk(
                        {
                            "index": self.continuation.index,
                            "delta": {"role": ASSISTANT, "content": ""},
                            "finish_reason": None,
                        },
                        chunk,
                    )
                )
                self._role_sent = True
            out.append(self._chunk(rebuilt, chunk))
        return out

    def _chunk(self, choice: dict[str, Any], source: dict[str, Any]) -> dict[str, Any]:
        prompt = self._prompt_tokens()
        completion = self.continuation.before + self.generated
        chunk = {
            "id": self.state.id,
            "object": CHUNK_OBJECT[self.client_path],
            "created": self.state.created,
            "model": self.state.model,
            "choices": [choice],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }
        # A restart's prompt is the original one: its ids are the state a later resume starts from.
        if self.continuation.mode == "restart" and "prompt_token_ids" in source:
            chunk["prompt_token_ids"] = source["prompt_token_ids"]
        return chunk

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        """The continuation's `choice` as the client's, or None when it is only a role chunk the
        client already had."""
        index = self.continuation.index
        if self.client_path == COMPLETIONS:
            restart = self.continuation.mode == "restart"
            rebuilt = {k: v for k, v in choice.items() if restart or k != "prompt_token_ids"}
            rebuilt["index"] = index
            rebuilt["logprobs"] = self._shifted(choice.get("logprobs"))
            return rebuilt
        if self.continuation.path == COMPLETIONS:  # a chat continued on its token ids: rebuild a chat choice
            rebuilt = {
                "index": index,
                "delta": {"content": choice.get("text") or ""},
                "logprobs": None,
                "finish_reason": choice.get("finish_reason"),
            }
            for key in ("stop_reason", "token_ids"):
                if key in choice:
                    rebuilt[key] = choice[key]
            return rebuilt
        delta = dict(choice.get("delta") or {})
        if "role" in delta:
            if not self._role_sent:
                self._role_sent = True
                return {**choice, "index": index}
            delta.pop("role")
            if not delta.get("content") and choice.get("finish_reason") is None and not delta.get("tool_calls"):
                return None  # the role chunk the client already had
        return {**choice, "index": index, "delta": delta}

    def _shifted(self, logprobs: Any) -> Any:
        """Completions logprobs with `text_offset` numbered on from the original choice's."""
        if not isinstance(logprobs, dict) or not isinstance(logprobs.get("text_offset"), list):
            return logprobs
        progress = self.state.choice(self.continuation.index)
        # A token continuation starts at the last whole character: its offsets count from there.
        base = progress.clean_logprob_offset if self.continuation.mode == "tokens" else progress.logprob_offset
        return {**logprobs, "text_offset": [_int(offset) + base for offset in logprobs["text_offset"]]}


def _after(logprobs: Any, skip: int) -> Any:
    """Completions logprobs without their first `skip` tokens' entries."""
    if not isinstance(logprobs, dict):
        return logprobs
    return {k: v[skip:] if isinstance(v, list) else v for k, v in logprobs.items()}


def final_usage_chunk(state: StreamState, *, client_path: str, n: int) -> dict[str, Any]:
    """The whole answer's usage, for the end of a resumed stream: every prompt once, every
    output token the client's choices had (the recorder's counts never fall below what was
    generated)."""
    prompt, completion = state.prompt_tokens(n=n), state.output_tokens()
    return {
        "id": state.id,
        "object": CHUNK_OBJECT[client_path],
        "created": state.created,
        "model": state.model,
        "choices": [],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def length_finish_chunk(state: StreamState, index: int, *, client_path: str) -> dict[str, Any]:
    """The end of a choice that had generated its whole limit when the stream was cut."""
    choice: dict[str, Any] = {"index": index, "finish_reason": "length"}
    if client_path == CHAT:
        choice.update(delta={}, logprobs=None)
    else:
        choice.update(text="", logprobs=None)
    return {
        "id": state.id,
        "object": CHUNK_OBJECT[client_path],
        "created": state.created,
        "model": state.model,
        "choices": [choice],
    }
