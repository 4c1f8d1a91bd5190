"""A deterministic stand-in for vLLM's streaming answers, in vLLM 0.32's chunk shapes.

Greedy decoding of a made-up model: the next token is a function of every token before it, so a
continuation fed the same token ids continues exactly, as a real greedy engine does (the real
engine is checked in test_exact_continuation_vllm.py). Like vLLM's detokenizer, some tokens
(`held`: a byte that starts a character) stream with no text, which comes with the next token;
and like tokenizers' `DecodeStream`, a prompt that ends in such a token makes the first text
released hold the whole prompt's text (`LEAK`), which a continuation must never cause. Chunk shapes follow
`entrypoints/openai/{chat_completion,completion}/serving.py`: chat sends a role chunk per choice
first (with `prompt_token_ids` when asked), completions put `prompt_token_ids` on each choice's
first chunk; usage per chunk counts one sequence; the final usage chunk has no choices.
"""

from __future__ import annotations

from typing import Any

EOS = 0
VOCAB = 97
LEAK = "<the prompt's text>"


def held(token: int) -> bool:
    return token != EOS and token % 5 == 0


def token_text(token: int) -> str:
    return f"w{token}" if held(token) else f"w{token} "


def next_token(sequence: list[int], stops: bool) -> int:
    token = (sum(sequence) * 7 + len(sequence) * 13) % VOCAB + 1
    return EOS if stops and token % 23 == 0 else token


def tokenize(text: str) -> list[int]:
    """Text never ends inside a character: no prompt token is a held one."""
    return [t + 1 if held(t) else t for t in (ord(c) % VOCAB + 1 for c in text)]


def render_chat(messages: list[dict[str, Any]], *, continue_final: bool) -> list[int]:
    ids: list[int] = []
    for i, message in enumerate(messages):
        ids += [98] + tokenize(str(message.get("role"))) + tokenize(str(message.get("content")))
        if not (continue_final and i == len(messages) - 1):
            ids.append(99)
    return ids if continue_final else ids + [98] + tokenize("assistant")


def _prompts(body: dict[str, Any]) -> list[list[int]]:
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [tokenize(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [tokenize(p) if isinstance(p, str) else list(p) for p in prompt]


def stream(
    path: str, body: dict[str, Any], *, stops: bool = False, chunk_id: str = "cmpl-x", created: int = 1000
) -> list[dict[str, Any] | str]:
    """The events vLLM would stream for `body` (JSON objects, then "[DONE]")."""
    chat = path == "/v1/chat/completions"
    n = body.get("n") or 1
    if chat:
        prompts = [render_chat(body["messages"], continue_final=bool(body.get("continue_final_message")))]
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 10_000
    else:
        prompts = _prompts(body)
        limit = body.get("max_tokens") or 16
    ids_on = bool(body.get("return_token_ids"))
    logprobs_on = not chat and body.get("logprobs") is not None
    base = {
        "id": chunk_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": body["model"],
    }
    events: list[dict[str, Any] | str] = []
    total_completion = 0
    if chat:  # vLLM sends every choice's role chunk first
        for index in range(n):
            usage = {"prompt_tokens": len(prompts[0]), "completion_tokens": 0, "total_tokens": len(prompts[0])}
            role = {
                **base,
                "choices": [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "usage": usage,
            }
            if ids_on:
                role["prompt_token_ids"] = prompts[0]
            events.append(role)
    for p, prompt in enumerate(prompts):
        for s in range(n):
            index = p * n + s
            sequence, generated, offset = list(prompt), [], 0  # greedy: every sequence of a prompt alike
            pending = LEAK if prompt and held(prompt[-1]) else ""
            while True:
                token = next_token(sequence, stops)
                sequence.append(token)
                generated.append(token)
                finish = "stop" if token == EOS else "length" if len(generated) >= limit else None
                pending += "" if token == EOS else token_text(token)
                text, pending = ("", pending) if held(token) and finish is None else (pending, "")
                choice: dict[str, Any] = {"index": index, "finish_reason": finish}
                if chat:
                    choice.update(delta={"content": text}, logprobs=None)
                else:
                    choice.update(text=text, logprobs=None, stop_reason=None)
                    if logprobs_on:
                        piece = token_text(token)  # vLLM's logprob tokens are each token's own string
                        choice["logprobs"] = {
                            "text_offset": [offset],
                            "token_logprobs": [-0.5],
                            "tokens": [piece],
                            "top_logprobs": [{piece: -0.5}],
                        }
                        offset += len(piece)
                    if ids_on and len(generated) == 1:
                        choice["prompt_token_ids"] = prompt
                if ids_on:
                    choice["token_ids"] = [token]
                usage = {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": len(generated),
                    "total_tokens": len(prompt) + len(generated),
                }
                events.append({**base, "choices": [choice], "usage": usage})
                if finish is not None:
                    break
            total_completion += len(generated)
    prompt_total = sum(len(p) for p in prompts)
    events.append(
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": prompt_total,
                "completion_tokens": total_completion,
                "total_tokens": prompt_total + total_completion,
            },
        }
    )
    events.append("[DONE]")
    return events
