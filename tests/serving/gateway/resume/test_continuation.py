"""The request that continues a cut answer: which way, within what budget, carrying what.

vLLM's own request classes read every continuation body (importing vLLM here is the point; the
gateway never does): what the engine would be told must be what the gateway meant.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

from serving.gateway.metering.output_bound import OutputBound, output_bound
from serving.gateway.resume.continuation import Continuation, Exhausted, NotResumable, continuations
from serving.gateway.resume.state import CHAT, COMPLETIONS, StreamRecorder
from tests.serving.gateway.resume import fake_engine
from tests.support.hypothesis import examples

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
SAMPLING = {
    "temperature": 0.7,
    "top_p": 0.9,
    "seed": 7,
    "frequency_penalty": 0.1,
    "presence_penalty": 0.2,
    "logit_bias": {"5": 1.0},
    "user": "u",
}
MAX_MODEL_LEN = 4096


def _state(path, body, cut, **kw):
    recorder = StreamRecorder(path)
    for event in fake_engine.stream(path, {**body, "return_token_ids": True}, **kw)[:cut]:
        recorder.record(event)
    return recorder.snapshot()


def _bound(path, body):
    return output_bound(body, path, context_length=None, ceiling=8192)


def _steps(path, body, cut, **kw):
    return continuations(body, path, _state(path, body, cut, **kw), _bound(path, body))


def vllm_params(step: Continuation) -> Any:
    """SamplingParams as vLLM's serving code makes them from the continuation's body."""
    if step.path == CHAT:
        request = ChatCompletionRequest.model_validate(step.body)
        limit = request.build_tok_params(SimpleNamespace(max_model_len=MAX_MODEL_LEN)).max_output_tokens or None
        prompt_length = 10
    else:
        request = CompletionRequest.model_validate(step.body)
        limit, prompt_length = request.max_tokens, len(request.prompt)
    return request.to_sampling_params(get_max_tokens(MAX_MODEL_LEN, limit, prompt_length, {}), {})


def test_a_chat_continues_on_its_token_ids_as_a_completion_with_the_rest_of_its_budget():
    body = {"model": "m", "messages": MESSAGES, "max_completion_tokens": 9, "stop": ["\n"], "min_tokens": 5, **SAMPLING}
    [step] = _steps(CHAT, body, 1 + 4)  # the role chunk and 4 tokens
    state = _state(CHAT, body, 5)
    assert step.mode == "tokens" and step.path == COMPLETIONS and step.before == 4
    assert step.body["prompt"] == [*state.choices[0].prompt_token_ids, *state.choices[0].token_ids]
    params = vllm_params(step)
    assert params.max_tokens == 5 and params.n == 1 and params.min_tokens == 1
    assert (params.temperature, params.top_p, params.seed, params.stop) == (0.7, 0.9, 7, ["\n"])
    assert (params.frequency_penalty, params.presence_penalty) == (0.1, 0.2)
    assert step.body["stream"] is True and step.body["return_token_ids"] is True
    assert step.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "messages" not in step.body and "max_completion_tokens" not in step.body


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"logprobs": True, "top_logprobs": 2},
        {"stop": ["END"]},  # vLLM holds back "EN" of the text it streams
        {"top_k": 3, "chat_template_kwargs": {"x": 1}, "vllm_xargs": {"a": 1}},  # an extension completions may not take
    ],
)
def test_a_chat_the_completions_route_cannot_carry_continues_as_chat_from_its_text(extra):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 9, **extra}
    [step] = _steps(CHAT, body, 1 + 3)
    assert step.mode == "text" and step.path == CHAT
    state = _state(CHAT, body, 4)
    assert step.body["messages"] == [*MESSAGES, {"role": "assistant", "content": state.choices[0].text}]
    assert step.body["continue_final_message"] is True and step.body["add_generation_prompt"] is False
    for key, value in extra.items():
        assert step.body[key] == value  # tools, logprobs, stop and extensions carry over
    request = ChatCompletionRequest.model_validate(step.body)  # vLLM accepts the pair of flags
    assert vllm_params(step).max_tokens == 6 and request.n == 1


def test_a_callers_own_prefill_is_extended_not_followed_by_a_second_assistant_message():
    messages = [*MESSAGES, {"role": "assistant", "content": "Once"}]
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": 9,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    [step] = _steps(CHAT, body, 1 + 2)
    text = _state(CHAT, body, 3).choices[0].text
    assert step.body["messages"][-1] == {"role": "assistant", "content": "Once" + text}
    assert len(step.body["messages"]) == 3


def test_completions_with_a_prompt_list_and_n_continue_each_unfinished_choice_on_its_own():
    body = {"model": "m", "prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "echo": False, "logprobs": 1}
    steps = _steps(COMPLETIONS, body, 3 + 3 + 1)  # choices 0 and 1 whole, choice 2 one token, choice 3 nothing
    assert [(s.index, s.mode, type(s).__name__) for s in steps] == [
        (2, "tokens", "Continuation"),
        (3, "restart", "Continuation"),
    ]
    tokens, restart = steps
    assert tokens.body["prompt"] == [*fake_engine.tokenize("cd"), *_state(COMPLETIONS, body, 7).choices[2].token_ids]
    assert restart.body["prompt"] == "cd" and restart.body["max_tokens"] == 3 and restart.body["n"] == 1
    assert [vllm_params(s).max_tokens for s in steps] == [2, 3]
    assert all(s.body["logprobs"] == 1 and not s.body.get("echo") for s in steps)


def test_an_echoed_completion_continues_without_echoing_again():
    body = {"model": "m", "prompt": "ab", "max_tokens": 4, "echo": True}
    [step] = _steps(COMPLETIONS, body, 2)
    assert step.mode == "tokens" and "echo" not in step.body
    assert CompletionRequest.model_validate(step.body).echo is False


def test_a_choice_that_reached_its_limit_only_lost_its_end():
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3}
    events = [e for e in fake_engine.stream(CHAT, {**body, "return_token_ids": True}) if isinstance(e, dict)]
    events[3]["choices"][0]["finish_reason"] = None  # the last token arrived, its finish did not
    recorder = StreamRecorder(CHAT)
    for event in events[:4]:
        recorder.record(event)
    assert continuations(body, CHAT, recorder.snapshot(), _bound(CHAT, body)) == [Exhausted(0)]


def test_the_gateways_own_max_tokens_is_the_limit_when_the_caller_set_none():
    body = {"model": "m", "messages": MESSAGES}
    bound = output_bound(body, CHAT, context_length=None, ceiling=6)
    assert bound.added_max_tokens == 6
    recorder = StreamRecorder(CHAT)
    for event in fake_engine.stream(CHAT, {**body, "max_tokens": 6, "return_token_ids": True})[:3]:
        recorder.record(event)
    [step] = continuations(body, CHAT, recorder.snapshot(), bound)
    assert step.body["max_tokens"] == 4


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        (CHAT, {"model": "m", "messages": MESSAGES, "response_format": {"type": "json_object"}}, "structured"),
        (CHAT, {"model": "m", "messages": MESSAGES, "structured_outputs": {"regex": "a+"}}, "structured"),
        (COMPLETIONS, {"model": "m", "prompt": "ab", "suffix": "z"}, "suffix"),
        (CHAT, {"model": "m", "messages": MESSAGES, "echo": True}, "echo"),
    ],
)
def test_what_cannot_be_continued_says_so(path, body, why):
    result = continuations(body, path, _state(path, {**body, "max_tokens": 5}, 3), OutputBound(per_sequence=5))
    assert isinstance(result, NotResumable) and why in result.reason


def test_a_streamed_tool_call_cannot_be_continued():
    recorder = StreamRecorder(CHAT)
    recorder.record({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    recorder.record(
        {"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "t"}]}, "token_ids": [4]}]}
    )
    result = continuations({"model": "m", "messages": MESSAGES}, CHAT, recorder.snapshot(), OutputBound(9))
    assert isinstance(result, NotResumable) and result.index == 0


def test_a_completion_of_token_ids_whose_answer_ids_are_unknown_cannot_be_continued_from_text():
    recorder = StreamRecorder(COMPLETIONS)
    recorder.record(
        {"id": "c", "choices": [{"index": 0, "text": "abc"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    )
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 5}
    assert isinstance(continuations(body, COMPLETIONS, recorder.snapshot(), OutputBound(5)), NotResumable)
    text_prompt = {**body, "prompt": "xyz"}
    [step] = continuations(text_prompt, COMPLETIONS, recorder.snapshot(), OutputBound(5))
    assert step.mode == "text" and step.body["prompt"] == "xyzabc" and step.body["max_tokens"] == 4


def test_a_token_continuation_starts_at_the_last_whole_character_and_replays_the_rest():
    recorder = StreamRecorder(COMPLETIONS)
    recorder.record(
        {
            "id": "c",
            "choices": [{"index": 0, "text": "a", "token_ids": [7], "prompt_token_ids": [1, 2]}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1},
        }
    )
    recorder.record(
        {
            "id": "c",
            "choices": [{"index": 0, "text": "", "token_ids": [8]}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 2},
        }
    )
    [step] = continuations(
        {"model": "m", "prompt": "xy", "max_tokens": 5}, COMPLETIONS, recorder.snapshot(), OutputBound(5)
    )
    assert step.mode == "tokens" and step.body["prompt"] == [1, 2, 7]
    assert (step.before, step.replayed, step.body["max_tokens"]) == (1, 1, 4)  # the answer stays within 5


def test_after_merged_deltas_a_chat_continues_from_its_text():
    recorder = StreamRecorder(CHAT)
    recorder.record({"id": "c", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    recorder.record({"id": "c", "choices": [{"index": 0, "delta": {"content": "ab"}, "token_ids": [7, 8]}]})
    [step] = continuations(
        {"model": "m", "messages": MESSAGES, "max_tokens": 5}, CHAT, recorder.snapshot(), OutputBound(5)
    )
    assert step.mode == "text" and step.body["messages"][-1] == {"role": "assistant", "content": "ab"}


@settings(max_examples=examples(fast=300, deep=5000))
@given(
    path=st.sampled_from([CHAT, COMPLETIONS]),
    limit=st.integers(1, 50),
    n=st.integers(1, 3),
    per_choice=st.lists(
        st.lists(st.tuples(st.sampled_from(["", "a", "bc"]), st.integers(0, 3)), max_size=12), min_size=1, max_size=3
    ),
    reported=st.lists(st.integers(0, 80), min_size=3, max_size=3),
    min_tokens=st.none() | st.integers(0, 60),
)
def test_a_continuation_never_asks_for_more_than_what_is_left_of_the_original_budget(
    path, limit, n, per_choice, reported, min_tokens
):
    """Any recorded progress, even usage past the limit or ids the upstream never counted: the
    answer's output (what the client has plus what the continuation may generate) stays within
    the original limit, on both sides: exactly the limit, never above it."""
    recorder = StreamRecorder(path)
    for index, chunks in enumerate(per_choice[:n]):
        for number, (text, count) in enumerate(chunks):
            choice = {"index": index, "token_ids": list(range(10, 10 + count))}
            choice.update({"delta": {"content": text}} if path == CHAT else {"text": text})
            if path == COMPLETIONS and number == 0:
                choice["prompt_token_ids"] = [1, 2]
            event = {
                "id": "c",
                "choices": [choice],
                "usage": {"prompt_tokens": 2, "completion_tokens": reported[index]},
            }
            if path == CHAT:
                event["prompt_token_ids"] = [1, 2]
            recorder.record(event)
    document = {"model": "m", "max_tokens": limit, "n": n}
    if min_tokens is not None:
        document["min_tokens"] = min(min_tokens, limit)  # vLLM refuses min_tokens above max_tokens
    document.update({"messages": MESSAGES} if path == CHAT else {"prompt": "xy"})
    state = recorder.snapshot()
    bound = OutputBound(per_sequence=limit, sequences=n)
    steps = continuations(document, path, state, bound)
    assert not isinstance(steps, NotResumable)
    for step in steps:
        progress = state.choice(step.index)
        if isinstance(step, Exhausted):
            assert progress.output_tokens >= limit
            continue
        asked = (
            step.body.get("max_tokens")
            if step.body.get("max_tokens") is not None
            else step.body["max_completion_tokens"]
        )
        assert 1 <= asked and step.before >= 0
        assert step.before + asked == limit  # exactly the original budget for the whole answer
        assert asked - step.replayed <= limit - progress.output_tokens  # new output within what was left
        assert step.body["n"] == 1 and step.body.get("min_tokens", 0) <= asked
        vllm_params(step)  # and vLLM reads the body
