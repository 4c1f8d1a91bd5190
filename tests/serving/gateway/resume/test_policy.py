"""Why a stream ended and what follows: a client cut is never resumed, limits end in an error event."""

from __future__ import annotations

import json

import aiohttp
import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.gateway.resume.ending import (
    Cut,
    EndReason,
    StreamEnd,
    classify,
    cut_of,
    is_engine_error_event,
    replica_unavailable,
)
from serving.gateway.resume.policy import Action, ResumeSettings, decide, error_event
from tests.support.hypothesis import examples

SETTINGS = ResumeSettings()
ends = st.builds(
    StreamEnd,
    client_gone=st.booleans(),
    saw_done=st.booleans(),
    saw_error_event=st.booleans(),
    all_finished=st.booleans(),
    cut=st.sampled_from(Cut),
    status=st.sampled_from([200, 500, 502, 503, 504]),
    engine_error=st.booleans(),
)


@pytest.mark.parametrize(
    ("end", "reason"),
    [
        (StreamEnd(cut=Cut.CONNECTION_RESET), EndReason.CONNECTION_RESET),
        (StreamEnd(), EndReason.EOF_WITHOUT_DONE),
        (StreamEnd(cut=Cut.IDLE_TIMEOUT), EndReason.IDLE_TIMEOUT),
        (StreamEnd(status=502), EndReason.UPSTREAM_UNAVAILABLE),
        (StreamEnd(status=503), EndReason.UPSTREAM_UNAVAILABLE),
        (StreamEnd(status=500, unavailable=True), EndReason.UPSTREAM_UNAVAILABLE),  # Ray's HAProxy page
        (StreamEnd(saw_done=True), EndReason.DONE),
        (StreamEnd(saw_error_event=True, cut=Cut.CONNECTION_RESET), EndReason.ERROR_EVENT),
        (StreamEnd(cut=Cut.TOTAL_TIMEOUT), EndReason.TOTAL_TIMEOUT),
        (StreamEnd(status=500), EndReason.UPSTREAM_FAILED),
        (StreamEnd(cut=Cut.OTHER), EndReason.UPSTREAM_FAILED),
        (StreamEnd(all_finished=True), EndReason.ALL_FINISHED),
        (StreamEnd(client_gone=True, cut=Cut.CONNECTION_RESET), EndReason.CLIENT_GONE),
        (StreamEnd(engine_error=True, saw_done=True), EndReason.ENGINE_ERROR),
        (StreamEnd(engine_error=True, client_gone=True), EndReason.CLIENT_GONE),
        (StreamEnd(engine_error=True, cut=Cut.TOTAL_TIMEOUT), EndReason.TOTAL_TIMEOUT),
    ],
)
def test_each_end_has_its_reason(end, reason):
    assert classify(end) is reason


@pytest.mark.parametrize(
    ("end", "action"),
    [
        (StreamEnd(cut=Cut.CONNECTION_RESET), Action.RESUME),
        (StreamEnd(status=503), Action.RESUME),
        (StreamEnd(status=500, unavailable=True), Action.RESUME),
        (StreamEnd(saw_done=True), Action.FINISH),
        (StreamEnd(saw_error_event=True), Action.FINISH),
        (StreamEnd(all_finished=True), Action.COMPLETE),
        (StreamEnd(cut=Cut.TOTAL_TIMEOUT), Action.GIVE_UP),
        (StreamEnd(status=500), Action.GIVE_UP),
        (StreamEnd(client_gone=True), Action.STOP),
        (StreamEnd(engine_error=True, saw_done=True), Action.RESUME),
    ],
)
def test_each_end_has_its_action(end, action):
    assert decide(end, resumes=0, now=0.0, deadline=10.0, settings=SETTINGS).action is action


@settings(max_examples=examples(fast=200, deep=5000))
@given(end=ends, resumes=st.integers(0, 5), now=st.floats(0, 20), max_resumes=st.integers(0, 10))
def test_a_client_cut_is_never_resumed_whatever_else_the_relay_saw(end, resumes, now, max_resumes):
    decision = decide(
        StreamEnd(**{**end.__dict__, "client_gone": True}),
        resumes=resumes,
        now=now,
        deadline=10.0,
        settings=ResumeSettings(max_resumes=max_resumes),
    )
    assert decision.action is Action.STOP


@settings(max_examples=examples(fast=200, deep=5000))
@given(end=ends, resumes=st.integers(0, 5), now=st.floats(0, 20), max_resumes=st.integers(0, 10))
def test_a_resume_stays_within_the_count_and_the_deadline(end, resumes, now, max_resumes):
    decision = decide(end, resumes=resumes, now=now, deadline=10.0, settings=ResumeSettings(max_resumes=max_resumes))
    if decision.action is Action.RESUME:
        # [DONE] ends the answer, unless a server-side error event came before it (the engine stopped)
        assert resumes < max_resumes and now < 10.0 and not end.client_gone and (end.engine_error or not end.saw_done)
    resumable = classify(end) in (
        EndReason.CONNECTION_RESET,
        EndReason.EOF_WITHOUT_DONE,
        EndReason.IDLE_TIMEOUT,
        EndReason.UPSTREAM_UNAVAILABLE,
        EndReason.ENGINE_ERROR,
    )
    if resumable and resumes < max_resumes and now < 10.0:
        assert decision.action is Action.RESUME  # the other side: a lost replica within limits is resumed
    if resumable and decision.action is not Action.RESUME:
        assert decision.action is Action.GIVE_UP and decision.message


def test_the_limit_and_the_deadline_end_in_an_error_not_a_cut():
    end = StreamEnd(cut=Cut.CONNECTION_RESET)
    assert decide(end, resumes=1, now=0, deadline=1, settings=SETTINGS).action is Action.RESUME
    assert decide(end, resumes=2, now=0, deadline=1, settings=SETTINGS).action is Action.GIVE_UP
    assert decide(end, resumes=0, now=1, deadline=1, settings=SETTINGS).action is Action.GIVE_UP
    assert decide(end, resumes=0, now=0, deadline=1, settings=ResumeSettings(max_resumes=0)).action is Action.GIVE_UP


def test_the_official_client_raises_on_the_error_event_instead_of_taking_the_answer_as_whole():
    chunk = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "finish_reason": None}],
    }
    body = b"data: " + json.dumps(chunk).encode() + b"\n\n" + error_event("interrupted") + b"\n\ndata: [DONE]\n\n"
    transport = httpx.MockTransport(
        lambda request: httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    )
    client = openai.OpenAI(
        api_key="k", base_url="http://gateway.test/v1", http_client=httpx.Client(transport=transport)
    )
    stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], stream=True)
    seen = []
    with pytest.raises(openai.APIError, match="interrupted"):
        for part in stream:
            seen.append(part.choices[0].delta.content)
    assert seen == ["Hel"]


@pytest.mark.parametrize(
    ("event", "engine"),
    [
        ({"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError", "code": 500}}, True),
        ({"error": {"message": "Request failed; please retry", "type": "ServiceUnavailableError", "code": 503}}, True),
        ({"error": {"message": "x", "type": "InternalServerError"}}, True),
        ({"error": {"message": "bad", "type": "BadRequestError", "code": 400}}, False),
        ({"error": "not an object"}, False),
        ({"choices": []}, False),
    ],
)
def test_only_a_server_side_error_event_is_an_engine_error(event, engine):
    assert is_engine_error_event(event) is engine


def test_what_aiohttp_raises_maps_to_a_cut():
    assert cut_of(None) is Cut.NONE
    assert cut_of(aiohttp.ClientPayloadError("Response payload is not completed")) is Cut.CONNECTION_RESET
    assert cut_of(aiohttp.ServerDisconnectedError()) is Cut.CONNECTION_RESET
    assert cut_of(ConnectionResetError()) is Cut.CONNECTION_RESET
    assert cut_of(aiohttp.ServerTimeoutError("read")) is Cut.IDLE_TIMEOUT
    assert cut_of(TimeoutError()) is Cut.TOTAL_TIMEOUT
    assert cut_of(ValueError()) is Cut.OTHER


@pytest.mark.parametrize(
    ("status", "content_type", "length", "lost"),
    [
        (502, "text/html", 100, True),
        (503, None, None, True),
        (500, "text/plain", 21, True),  # Ray's HAProxy serves its 502/503/504 as this page
        (500, "application/json", 21, False),  # vLLM's errors are JSON: the request's or the engine's
        (500, "application/octet-stream", 21, False),  # a Serve replica's own unhandled exception
        (500, "text/plain", 22, False),
        (504, "text/plain", 21, False),  # a timeout: the engine may still be working on it
    ],
)
def test_only_a_page_of_a_proxy_that_found_no_replica_counts_as_unavailable(status, content_type, length, lost):
    assert replica_unavailable(status, content_type, length) is lost
