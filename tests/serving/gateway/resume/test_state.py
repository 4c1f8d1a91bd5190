"""What the relay records of a stream: per choice text, token ids, counts, finish, logprob offsets."""

from __future__ import annotations

from serving.gateway.resume.state import CHAT, COMPLETIONS, StreamRecorder, client_view, with_token_ids
from tests.serving.gateway.resume import fake_engine

CHAT_BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 6,
    "n": 2,
    "return_token_ids": True,
}


def _recorded(path, events):
    recorder = StreamRecorder(path)
    for event in events:
        if isinstance(event, dict):
            recorder.record(event)
    return recorder.snapshot()


def test_a_chat_stream_is_recorded_per_choice_with_its_token_ids_and_prompt():
    events = fake_engine.stream(CHAT, CHAT_BODY, chunk_id="chatcmpl-1", created=77)
    state = _recorded(CHAT, events[:5])  # both role chunks, then 3 tokens of choice 0
    assert (state.id, state.created, state.model) == ("chatcmpl-1", 77, "m")
    first, second = state.choices
    prompt = fake_engine.render_chat(CHAT_BODY["messages"], continue_final=False)
    assert first.prompt_token_ids == tuple(prompt) and first.prompt_tokens == len(prompt)
    assert len(first.token_ids) == 3 == first.output_tokens
    assert first.text == "".join(fake_engine.token_text(t) for t in first.token_ids)
    assert first.role_sent and not first.finished
    assert second.role_sent and second.output_tokens == 0 and second.token_ids == ()


def test_every_choice_finishes_and_the_prompt_is_counted_once_per_prompt():
    state = _recorded(CHAT, fake_engine.stream(CHAT, CHAT_BODY))
    assert all(c.finish_reason == "length" and c.output_tokens == 6 for c in state.choices)
    assert state.prompt_tokens(n=2) == state.choices[0].prompt_tokens  # two choices, one prompt
    assert state.output_tokens() == 12 and state.final_usage_seen


def test_generated_text_without_its_token_ids_makes_the_token_state_unknown_never_wrong():
    events = [e for e in fake_engine.stream(CHAT, CHAT_BODY) if isinstance(e, dict)]
    events[3]["choices"][0].pop("token_ids")
    state = _recorded(CHAT, events[:6])
    assert state.choices[0].token_ids is None
    assert state.choices[0].output_tokens == 4  # the usage still counts what was generated


def test_completions_record_the_next_logprob_offset_as_vllm_numbers_it():
    body = {"model": "m", "prompt": ["ab", "cd"], "max_tokens": 4, "logprobs": 1, "return_token_ids": True}
    events = fake_engine.stream(COMPLETIONS, body)
    state = _recorded(COMPLETIONS, events[:6])  # prompt 0 whole (4), prompt 1's first 2
    assert [c.index for c in state.choices] == [0, 1]
    assert state.choices[1].logprob_offset == len(state.choices[1].text)
    assert state.choices[1].prompt_token_ids == tuple(fake_engine.tokenize("cd"))
    assert state.choices[0].finish_reason == "length"


def test_an_error_event_is_noted():
    recorder = StreamRecorder(CHAT)
    recorder.record({"error": {"message": "boom", "code": 500}})
    assert recorder.snapshot().error_event_seen


def test_the_client_gets_token_ids_only_if_it_asked():
    chunk = {
        "id": "x",
        "prompt_token_ids": [1],
        "choices": [{"index": 0, "token_ids": [5], "text": "a", "prompt_token_ids": [1]}],
    }
    assert client_view(chunk, client_asked_token_ids=False) == {"id": "x", "choices": [{"index": 0, "text": "a"}]}
    assert client_view(chunk, client_asked_token_ids=True) == chunk
    assert with_token_ids({"model": "m"}) == {"model": "m", "return_token_ids": True}


def test_the_seam_is_the_last_whole_character_the_client_has():
    recorder = StreamRecorder(COMPLETIONS)
    for text, ids in (("a", [1]), ("", [2]), ("", [3])):  # 2 and 3: a character still incomplete
        recorder.record({"id": "c", "choices": [{"index": 0, "text": text, "token_ids": ids}]})
    assert recorder.snapshot().choices[0].clean_tokens == 1
    recorder.record({"id": "c", "choices": [{"index": 0, "text": "é", "token_ids": [4]}]})
    assert recorder.snapshot().choices[0].clean_tokens == 4
    recorder.record({"id": "c", "choices": [{"index": 0, "text": "bc", "token_ids": [5, 6]}]})  # merged deltas
    assert recorder.snapshot().choices[0].clean_tokens is None
