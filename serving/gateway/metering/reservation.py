"""What a request reserves at admission (pure code): a bound on its prompt tokens that cannot
under-count, plus the most output it allows, for every prompt and every sequence it asks for.

Prompt bound. The gateway has no tokenizer, so it counts bytes: a token of a byte-level BPE
vocabulary (GPT-2, Llama 3, Qwen...) covers at least one byte of text, and a JSON body is at
least as long as the UTF-8 text it carries (escapes only ever lengthen it), so the body's size
bounds the tokens of everything in it - messages, names, tool calls and their arguments, tools,
documents, chat-template arguments, prompts given as token ids (each id is at least one digit).
On top of that, `TOKENS_PER_VALUE` per JSON value of the body, for what a template or
tokenizer adds around each one (role markers, BOS/EOS, the newline and indent of tools
rendered as pretty-printed JSON, SentencePiece's prefix space), and for chat the stack's
`chat_template_tokens` (the template's own text: default system prompt, tool instructions).
A media part (image, audio, video: anything in a message's content that is not text) may
become any number of tokens, so it counts a whole context. The bound is then capped at the
model's context length per prompt, which vLLM enforces on every prompt it accepts.

Output. The most the engine may generate for the body, by the engine's own rule
(serving.gateway.metering.output_bound): its limit per sequence, for every sequence of every prompt.

Being high is cheap: settlement refunds everything the upstream did not report using. Being
low would let a request use more than its key was charged for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serving.gateway.metering import output_bound
from serving.gateway.metering.output_bound import OutputBound

COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
TOKENS_PER_VALUE = 4
# A media part of a model whose context length the gateway was not told: it is assumed to fill this.
UNKNOWN_CONTEXT_TOKENS = 32_768
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal"})
# Where /v1/embeddings takes its prompts (completions: serving.gateway.metering.output_bound).
PROMPT_FIELDS = {"/v1/embeddings": "input"}


@dataclass(frozen=True)
class Reservation:
    prompt: int  # bound on prompt tokens, every prompt together
    output: int  # bound on output tokens, every sequence together
    prompts: int = 1
    n: int = 1  # sequences per prompt (their indexes in a stream: prompt * n + i)

    @property
    def total(self) -> int:
        return self.prompt + self.output


def positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def prompt_count(document: dict[str, Any] | None, path: str) -> int:
    """Prompts in one request: /v1/completions' (serving.gateway.metering.output_bound) and /v1/embeddings'
    `input`, which may be a list of prompts - strings or token-id lists - each embedded on its own."""
    if document is not None and path == output_bound.COMPLETIONS:
        return output_bound.prompt_count(document, path)
    field = PROMPT_FIELDS.get(path)
    value = document.get(field) if document is not None and field else None
    if isinstance(value, list) and value and all(isinstance(item, (str, list)) for item in value):
        return len(value)
    return 1


def choices_per_prompt(document: dict[str, Any]) -> int:
    """Sequences a request asks for per prompt, for the gateway's `max_n` ceiling: `n`, or
    `best_of` when larger (OpenAI's legacy field; vLLM 0.32 ignores it, but a client sending it
    means it)."""
    return max(positive_int(document.get("n")) or 1, positive_int(document.get("best_of")) or 1)


def _values_and_media(document: Any) -> tuple[int, int]:
    """JSON values in `document` (every container and scalar, the root included), and media
    parts in chat messages' content."""
    values, media, stack = 1, 0, [document]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            values += len(node)
            stack.extend(v for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            values += len(node)
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    messages = document.get("messages") if isinstance(document, dict) else None
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            media += sum(1 for part in content if not (isinstance(part, dict) and part.get("type") in TEXT_PART_TYPES))
    if isinstance(document, dict) and document.get("mm_payload") is not None:  # vLLM: media for /v1/completions
        media += 1
    return values, media


def prompt_bound(document: Any, body_size: int, path: str, *, context_length: int | None, template_tokens: int) -> int:
    """Tokens the request's prompts can be at most (module docstring). `body_size`: the body's
    length in bytes as received; `document`: the same body parsed (None when it is not JSON)."""
    if body_size == 0:
        return 0
    values, media = _values_and_media(document)
    bound = body_size + TOKENS_PER_VALUE * values + media * (context_length or UNKNOWN_CONTEXT_TOKENS)
    if path == "/v1/chat/completions":
        bound += template_tokens
    if context_length is not None:
        bound = min(bound, prompt_count(document if isinstance(document, dict) else None, path) * context_length)
    return bound


def reserve(
    document: dict[str, Any] | None,
    body_size: int,
    path: str,
    *,
    output: OutputBound,
    context_length: int | None,
    template_tokens: int,
) -> Reservation:
    """The reservation of one request: its prompt bound, and the most output it may generate."""
    prompt = prompt_bound(document, body_size, path, context_length=context_length, template_tokens=template_tokens)
    return Reservation(prompt=prompt, output=output.total, prompts=output.prompts, n=output.sequences)
