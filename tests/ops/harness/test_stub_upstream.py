"""The stub upstream streams like vLLM: usage in every chunk only when asked for continuous usage."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from ops.harness.stub_upstream import app


def events(options: dict | None) -> list[dict]:
    body = {"model": "tiny", "stream": True, "messages": [{"role": "user", "content": '#stub {"chunks": 3}'}]}
    if options is not None:
        body["stream_options"] = options
    with TestClient(app()) as client:
        text = client.post("/v1/chat/completions", json=body).text
    return [json.loads(line[len("data: ") :]) for line in text.split("\n\n") if line.startswith("data: {")]


def test_continuous_usage_counts_each_chunks_tokens_so_far():
    chunks = events({"include_usage": True, "continuous_usage_stats": True})
    assert [c["usage"]["completion_tokens"] for c in chunks] == [0, 1, 2, 3, 3, 3]  # role, 3 tokens, finish, final
    assert chunks[-1]["choices"] == []


def test_without_continuous_usage_only_the_final_chunk_has_usage():
    assert [c["usage"] for c in events({"include_usage": True})][:-1] == [None] * 5
    assert all(c["usage"] is None for c in events(None))
