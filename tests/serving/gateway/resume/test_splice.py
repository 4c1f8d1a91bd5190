"""A resumed stream reads as the uninterrupted one: same id, created, model, indexes, one role
chunk, logprob offsets numbered on, the whole answer billed once (and never less)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.metering.output_bound import output_bound
from serving.gateway.resume.continuation import Continuation, continuations
from serving.gateway.resume.splice import Splice
from serving.gateway.resume.state import CHAT, COMPLETIONS, StreamRecorder
from tests.serving.gateway.resume import fake_engine
from tests.serving.gateway.resume.relay_sim import finishes, resumed, texts
from tests.support.hypothesis import examples

MESSAGES = [{"role": "user", "content": "tell me"}]


def _bound(path, body):
    return output_bound(body, path, context_length=None, ceiling=8192)


def _usage(events):
    return [e["usage"] for e in events if not e.get("choices")][-1]


def _chunk_usage(events):
    """Per choice, the usage each of its chunks carried: what the meter bills a stream cut again."""
    out = {}
    for event in events:
        for choice in event.get("choices") or []:
            out.setdefault(choice["index"], []).append(
                (event["usage"]["prompt_tokens"], event["usage"]["completion_tokens"])
            )
    return out


def test_a_chat_cut_mid_answer_reads_as_the_uninterrupted_one():
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 12, "n": 2}
    whole, _, _ = resumed(CHAT, body, _bound(CHAT, body), [])
    spliced, state, [first, second] = resumed(CHAT, body, _bound(CHAT, body), [2 + 5])  # roles, 5 tokens of choice 0
    assert texts(spliced, CHAT) == texts(whole, CHAT) and finishes(spliced) == finishes(whole)
    assert {(e["id"], e["created"], e["model"], e["object"]) for e in spliced} == {
        ("cmpl-x", 1000, "m", "chat.completion.chunk")
    }
    roles = [c["index"] for e in spliced for c in e["choices"] if "role" in c["delta"]]
    assert sorted(roles) == [0, 1]  # one role chunk per choice, none from the continuations
    assert _usage(spliced) == _usage(whole)  # the prompt once, every output token once
    assert (first.continuation.mode, second.continuation.mode) == ("tokens", "restart")  # choice 1 had no text
    # The re-done prefill is the platform's: the prompt again plus the 5 tokens the first choice had.
    assert first.overhead_prompt_tokens == _usage(whole)["prompt_tokens"] + 5
    assert second.overhead_prompt_tokens == _usage(whole)["prompt_tokens"]


def test_a_chat_cut_before_any_text_restarts_without_a_second_role_chunk():
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 5}
    whole, _, _ = resumed(CHAT, body, _bound(CHAT, body), [])
    spliced, _, [splice] = resumed(CHAT, body, _bound(CHAT, body), [1])
    assert splice.continuation.mode == "restart"
    assert texts(spliced, CHAT) == texts(whole, CHAT) and _usage(spliced) == _usage(whole)
    assert sum("role" in c["delta"] for e in spliced for c in e["choices"]) == 1


def test_completion_logprob_offsets_go_on_from_the_cut():
    body = {"model": "m", "prompt": "abc", "max_tokens": 8, "logprobs": 0}
    whole, _, _ = resumed(COMPLETIONS, body, _bound(COMPLETIONS, body), [])
    spliced, _, _ = resumed(COMPLETIONS, body, _bound(COMPLETIONS, body), [3])

    def offsets(events):
        return [o for e in events for c in e.get("choices") or [] for o in (c.get("logprobs") or {})["text_offset"]]

    assert offsets(spliced) == offsets(whole) == sorted(set(offsets(whole)))
    assert texts(spliced, COMPLETIONS) == texts(whole, COMPLETIONS)


def test_a_continuation_cut_again_is_resumed_from_everything_the_client_has():
    body = {"model": "m", "messages": MESSAGES, "max_completion_tokens": 15}
    whole, _, _ = resumed(CHAT, body, _bound(CHAT, body), [])
    spliced, _, splices = resumed(CHAT, body, _bound(CHAT, body), [1 + 4, 3])
    assert [s.continuation.before for s in splices] == [4, 7]
    assert [s.continuation.body["max_tokens"] for s in splices] == [11, 8]
    assert texts(spliced, CHAT) == texts(whole, CHAT) and _usage(spliced) == _usage(whole)


def test_the_continuations_own_final_usage_is_dropped_and_its_prompt_never_billed():
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 6}
    recorder = StreamRecorder(CHAT)
    for event in fake_engine.stream(CHAT, {**body, "return_token_ids": True})[:3]:
        recorder.record(event)
    state = recorder.snapshot()
    [step] = continuations(body, CHAT, state, _bound(CHAT, body))
    splice = Splice(state, step, CHAT)
    out = [splice.rewrite(e) for e in fake_engine.stream(step.path, step.body) if isinstance(e, dict)]
    assert out[-1] == []  # the continuation's final usage chunk
    usages = [chunk["usage"] for chunks in out for chunk in chunks]
    assert {u["prompt_tokens"] for u in usages} == {state.choices[0].prompt_tokens}
    assert [u["completion_tokens"] for u in usages] == [3, 4, 5, 6]


def test_a_text_continuation_keeps_the_chat_chunks_and_drops_their_role():
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 6, "logprobs": True}
    spliced, _, [splice] = resumed(CHAT, body, _bound(CHAT, body), [3])
    assert splice.continuation.mode == "text"
    assert sum("role" in c["delta"] for e in spliced for c in e["choices"]) == 1
    assert {e["id"] for e in spliced} == {"cmpl-x"}
    assert _usage(spliced)["completion_tokens"] == 6


cases = st.sampled_from([CHAT, COMPLETIONS]).flatmap(
    lambda path: st.fixed_dictionaries(
        {
            "path": st.just(path),
            "limit": st.integers(1, 12),
            "n": st.integers(1, 3),
            "prompts": st.lists(
                st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=1 if path == CHAT else 3
            ),
            "stops": st.booleans(),
            "cuts": st.lists(st.integers(0, 40), min_size=1, max_size=3),
        }
    )
)


def _body(case):
    if case["path"] == CHAT:
        return {
            "model": "m",
            "messages": [{"role": "user", "content": case["prompts"][0]}],
            "max_completion_tokens": case["limit"],
            "n": case["n"],
        }
    prompt = case["prompts"] if len(case["prompts"]) > 1 else case["prompts"][0]
    return {"model": "m", "prompt": prompt, "max_tokens": case["limit"], "n": case["n"]}


@settings(max_examples=examples(fast=150, deep=3000))
@given(case=cases)
def test_any_cut_of_a_greedy_stream_splices_into_the_uninterrupted_answer_billed_exactly(case):
    path, body = case["path"], _body(case)
    bound = _bound(path, body)
    whole, _, _ = resumed(path, body, bound, [], stops=case["stops"])
    spliced, state, splices = resumed(
        path, body, bound, case["cuts"][: 2 if len(case["cuts"]) > 1 else 1], stops=case["stops"]
    )
    assert texts(spliced, path) == texts(whole, path)
    assert finishes(spliced) == finishes(whole)
    assert _usage(spliced) == _usage(whole)  # both sides: never less, and never more
    assert _chunk_usage(spliced) == _chunk_usage(whole)
    for splice in splices:
        step = splice.continuation
        assert step.before + (step.body.get("max_tokens") or step.body.get("max_completion_tokens")) == case["limit"]
    assert all(s.overhead_prompt_tokens >= s.continuation.before for s in splices)


@settings(max_examples=examples(fast=150, deep=3000))
@given(limit=st.integers(2, 12), cut=st.integers(2, 12), dropped=st.sets(st.integers(0, 12)), lowered=st.integers(0, 5))
def test_a_continuation_that_under_reports_its_usage_is_still_billed_every_token_it_sent(limit, cut, dropped, lowered):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": limit}
    recorder = StreamRecorder(CHAT)
    for event in fake_engine.stream(CHAT, {**body, "return_token_ids": True})[:cut]:
        if isinstance(event, dict):
            recorder.record(event)
    state = recorder.snapshot()
    steps = continuations(body, CHAT, state, _bound(CHAT, body))
    sent = sum(len(c.token_ids or ()) for c in state.choices)
    for step in steps:
        if not isinstance(step, Continuation):
            continue
        splice = Splice(state, step, CHAT)
        events = [e for e in fake_engine.stream(step.path, step.body) if isinstance(e, dict)]
        for i, event in enumerate(events):
            if i in dropped:
                event.pop("usage", None)
            elif event.get("usage"):  # an upstream that says it generated less than it sent
                event["usage"]["completion_tokens"] = max(0, event["usage"]["completion_tokens"] - lowered)
            for out in splice.rewrite(event):
                recorder.record(out)
                sent += len(out["choices"][0].get("token_ids") or [])
                assert out["usage"]["completion_tokens"] >= sent  # each chunk bills at least what was sent
    final = recorder.snapshot()
    assert final.output_tokens() >= sent
    assert final.prompt_tokens(n=1) == state.choices[0].prompt_tokens
