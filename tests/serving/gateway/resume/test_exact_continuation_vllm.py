"""The continuation body on the real engine: CPU vLLM 0.32 on the tiny local model, offline.

A greedy answer of N tokens, and the same answer cut after k tokens (for every k) and continued
with the body serving.gateway.resume builds, spliced as the relay would: the client's text, token
ids and finish are identical. vLLM's own request classes turn each body into the engine's
SamplingParams and prompt, as its OpenAI server does. One engine for the module, in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine process to start or leave behind).
"""

from __future__ import annotations

import gc
import os
from typing import Any

import pytest

from ops.devstack.tiny_model import ensure_tiny_model
from serving.gateway.metering.output_bound import output_bound
from serving.gateway.resume.continuation import Continuation, continuations
from serving.gateway.resume.splice import Splice
from serving.gateway.resume.state import CHAT, COMPLETIONS, StreamRecorder

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
N = 40
ENGINE_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="module")
def llm():
    saved = {name: os.environ.get(name) for name in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    from vllm import LLM

    engine = LLM(model=str(ensure_tiny_model()), max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0)
    try:
        yield engine
    finally:
        del engine
        gc.collect()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _params(path: str, body: dict[str, Any], prompt_length: int) -> Any:
    """SamplingParams as vLLM's OpenAI server makes them from `body`."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    if path == CHAT:
        request = ChatCompletionRequest.model_validate(body)
        limit = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    else:
        request = CompletionRequest.model_validate(body)
        limit = request.max_tokens
    return request.to_sampling_params(get_max_tokens(MAX_MODEL_LEN, limit, prompt_length, {}), {})


def _streamed(llm: Any, requests: list[tuple[list[int], Any]]) -> list[list[tuple[str, list[int], str | None]]]:
    """Each request's stream as vLLM's OpenAI server gets it (RequestOutputKind.DELTA, the output
    processor the server's AsyncLLM uses): per step, the new text, the new token ids, the finish."""
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    streams: dict[str, list[tuple[str, list[int], str | None]]] = {}
    for number, (prompt, params) in enumerate(requests):
        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        streams[f"r{number}"] = []
        engine.add_request(f"r{number}", TokensPrompt(prompt_token_ids=prompt), params)
    while engine.has_unfinished_requests():
        for output in engine.step():
            out = output.outputs[0]
            streams[output.request_id].append((out.text, list(out.token_ids), out.finish_reason))
    return [streams[f"r{number}"] for number in range(len(requests))]


def _relayed(path: str, prompt_ids: list[int], deltas: list[tuple[str, list[int], str | None]]) -> Any:
    """What the relay recorded of a stream cut after `deltas` reached the client."""
    recorder = StreamRecorder(path)
    head: dict[str, Any] = {"id": "cmpl-1", "created": 1, "model": "tiny"}
    if path == CHAT:
        recorder.record(
            {
                **head,
                "prompt_token_ids": prompt_ids,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": 0},
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            }
        )
    count = 0
    for number, (text, ids, finish) in enumerate(deltas):
        count += len(ids)
        choice: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": finish}
        if path == CHAT:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
            if number == 0:
                choice["prompt_token_ids"] = prompt_ids
        recorder.record(
            {**head, "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": count}}
        )
    return recorder.snapshot()


def _client_text(chunk: dict[str, Any], path: str) -> str:
    choice = chunk["choices"][0]
    return (choice["delta"].get("content") if path == CHAT else choice["text"]) or ""


def _limit_key(path: str) -> str:
    return "max_completion_tokens" if path == CHAT else "max_tokens"


def test_a_greedy_answer_cut_anywhere_continues_exactly_on_the_real_engine(llm):
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me a story about the sea."}],
        "max_completion_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
    }
    completion = {
        "model": "tiny",
        "prompt": "The harbour at dawn",
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
    }
    prompts = {
        CHAT: list(llm.chat(chat["messages"], _params(CHAT, chat, 0))[0].prompt_token_ids),
        COMPLETIONS: list(llm.generate(completion["prompt"], _params(COMPLETIONS, completion, 0))[0].prompt_token_ids),
    }
    bodies = {CHAT: chat, COMPLETIONS: completion}
    paths = (CHAT, COMPLETIONS)
    originals = _streamed(llm, [(prompts[p], _params(p, bodies[p], len(prompts[p]))) for p in paths for _ in range(2)])
    for number, path in enumerate(paths):
        first, second = originals[2 * number], originals[2 * number + 1]
        assert first == second  # the premise: greedy decoding on this CPU engine is deterministic
        assert sum(len(ids) for _, ids, _ in first) == N and first[-1][2] == "length"
    # Cut each answer after every one of its N - 1 first steps; continue each cut with the body
    # serving.gateway.resume builds, on the same engine (all continuations at once).
    cuts, steps = [], []
    for number, path in enumerate(paths):
        whole = originals[2 * number]
        bound = output_bound(bodies[path], path, context_length=MAX_MODEL_LEN, ceiling=MAX_MODEL_LEN)
        for k in range(1, len(whole)):
            state = _relayed(path, prompts[path], whole[:k])
            [step] = continuations(bodies[path], path, state, bound)
            assert isinstance(step, Continuation) and step.mode == "tokens" and step.path == COMPLETIONS
            cuts.append((path, whole, k, state))
            steps.append(step)
    tails = _streamed(llm, [(s.body["prompt"], _params(COMPLETIONS, s.body, len(s.body["prompt"]))) for s in steps])
    replays = 0
    for (path, whole, k, state), step, tail in zip(cuts, steps, tails):
        splice = Splice(state, step, path)
        text, ids, finish = "".join(t for t, _, _ in whole[:k]), [i for _, d, _ in whole[:k] for i in d], None
        generated = 0
        for delta_text, delta_ids, delta_finish in tail:
            generated += len(delta_ids)
            chunk = {
                "id": "cmpl-2",
                "object": "text_completion",
                "created": 2,
                "model": "tiny",
                "choices": [{"index": 0, "text": delta_text, "token_ids": delta_ids, "finish_reason": delta_finish}],
                "usage": {"prompt_tokens": len(step.body["prompt"]), "completion_tokens": generated},
            }
            for out in splice.rewrite(chunk):
                assert (out["id"], out["created"], out["model"]) == ("cmpl-1", 1, "tiny")
                text += _client_text(out, path)
                ids += out["choices"][0].get("token_ids") or []
                finish = out["choices"][0]["finish_reason"] or finish
                assert out["usage"]["prompt_tokens"] == len(prompts[path])
                assert out["usage"]["completion_tokens"] == step.before + generated
        assert (path, k, ids) == (path, k, [i for _, d, _ in whole for i in d])
        assert (path, k, text) == (path, k, "".join(t for t, _, _ in whole))
        assert finish == "length"
        assert step.before + step.replayed == k  # every step here is one token
        with_text = [number + 1 for number, (t, _, _) in enumerate(whole[:k]) if t]
        assert step.replayed == k - (with_text[-1] if with_text else 0)  # back to the last whole character
        replays += step.replayed > 0
        assert splice.overhead_prompt_tokens == len(step.body["prompt"]) == len(prompts[path]) + step.before
    assert replays  # the seam fell inside a character at least once (the chat's first token is a lone byte)
