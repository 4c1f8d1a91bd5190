"""The relay's one call at the end of an upstream stream, over the fake engine's streams."""

from __future__ import annotations

import json

from serving.gateway.metering.output_bound import OutputBound
from serving.gateway.resume.ending import Cut, EndReason, StreamEnd
from serving.gateway.resume.plan import Finish, GiveUp, Resume, Stop, after_upstream_end
from serving.gateway.resume.policy import ResumeSettings
from serving.gateway.resume.state import CHAT, StreamRecorder
from tests.serving.gateway.resume import fake_engine

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
BOUND = OutputBound(per_sequence=4, sequences=2)
RESET = StreamEnd(cut=Cut.CONNECTION_RESET)


def _state(cut, edit=None):
    recorder = StreamRecorder(CHAT)
    events = [e for e in fake_engine.stream(CHAT, {**BODY, "return_token_ids": True}) if isinstance(e, dict)]
    for event in (edit or (lambda e: e))(events)[:cut]:
        recorder.record(event)
    return recorder.snapshot()


def _after(end, state, *, document=BODY, resumes=0, now=0.0):
    return after_upstream_end(
        end,
        state=state,
        document=document,
        path=CHAT,
        bound=BOUND,
        resumes=resumes,
        now=now,
        deadline=10.0,
        settings=ResumeSettings(),
    )


def test_a_cut_mid_answer_resumes_each_unfinished_choice():
    outcome = _after(RESET, _state(2 + 3))
    assert isinstance(outcome, Resume) and outcome.reason is EndReason.CONNECTION_RESET and not outcome.events
    assert [(c.index, c.mode) for c in outcome.continuations] == [(0, "tokens"), (1, "restart")]


def test_a_client_cut_stops_everything():
    assert _after(StreamEnd(client_gone=True, cut=Cut.CONNECTION_RESET), _state(5)) == Stop(EndReason.CLIENT_GONE)


def test_a_stream_that_lost_only_its_end_is_completed_with_its_usage():
    state = _state(2 + 8)  # both choices finished; the final usage chunk and [DONE] lost
    outcome = _after(StreamEnd(all_finished=True), state)
    assert isinstance(outcome, Finish) and len(outcome.events) == 1
    assert outcome.events[0]["usage"]["completion_tokens"] == 8
    # Even for an answer that could not have been continued: there is nothing to continue.
    structured = {**BODY, "response_format": {"type": "json_object"}}
    assert _after(StreamEnd(all_finished=True), state, document=structured) == outcome


def test_choices_that_generated_their_limit_get_their_finish_not_a_continuation():
    def no_finish(events):  # the last token of each choice arrived, its finish did not
        for event in events:
            for choice in event.get("choices") or []:
                choice["finish_reason"] = None
        return events

    outcome = _after(RESET, _state(2 + 8, no_finish))
    assert isinstance(outcome, Finish)
    assert [e["choices"][0]["finish_reason"] for e in outcome.events[:2]] == ["length", "length"]
    assert outcome.events[2]["usage"]["completion_tokens"] == 8


def test_past_the_limit_or_for_an_answer_that_cannot_continue_the_client_gets_an_error_event():
    for outcome in (
        _after(RESET, _state(5), resumes=2),
        _after(RESET, _state(5), now=11.0),
        _after(RESET, _state(5), document={**BODY, "response_format": {"type": "json_object"}}),
    ):
        assert isinstance(outcome, GiveUp)
        error = json.loads(outcome.error.removeprefix(b"data: "))["error"]
        assert error["code"] == "stream_interrupted" and error["type"] == "server_error"


def test_a_clean_end_is_the_upstreams_answer():
    assert _after(StreamEnd(saw_done=True), _state(5)) == Finish(EndReason.DONE)
    assert _after(StreamEnd(saw_error_event=True), _state(5)) == Finish(EndReason.ERROR_EVENT)
