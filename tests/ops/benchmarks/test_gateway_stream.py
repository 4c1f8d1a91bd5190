"""The streaming gateway benchmark's pure parts: the request it sends."""

from __future__ import annotations

import json

from ops.benchmarks.gateway_stream import stream_body, wrk_script


def test_the_stub_is_asked_for_one_event_per_token_and_the_client_asks_for_no_usage():
    body = stream_body(64)
    assert body["stream"] is True and body["max_tokens"] == 64 and "stream_options" not in body
    assert json.loads(body["messages"][0]["content"].split("#stub ", 1)[1]) == {"chunks": 64}
    assert f"wrk.body = {json.dumps(json.dumps(body))}" in wrk_script("sk-llm-x", 64)


def test_a_pause_between_events_is_asked_of_the_stub_only_when_given():
    steer = stream_body(64, interval_ms=10)["messages"][0]["content"].split("#stub ", 1)[1]
    assert json.loads(steer) == {"chunks": 64, "interval_ms": 10}
