"""The Batch API through the official `openai` client, against a real gateway and redis-server:
upload, create, poll, download; cancel; expiry; tenants that cannot see each other's work."""

from __future__ import annotations

import json
import time

import openai
import pytest
from openai.types import Batch, FileObject

from tests.support.servers import HANG_BOUND_S


def chat_line(custom_id: str, model: str = "tiny", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"say {custom_id}"}], **body}}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_for(client: openai.OpenAI, batch_id: str, statuses: set[str]) -> Batch:
    deadline = time.monotonic() + HANG_BOUND_S
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or time.monotonic() > deadline:
            return batch
        time.sleep(0.05)


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_upload_create_poll_download_each_custom_id_once(client_for, make_key, recorded) -> None:
    client = client_for(make_key())
    ids = [f"req-{n}" for n in range(40)]
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in ids])), purpose="batch")
    assert isinstance(uploaded, FileObject) and uploaded.purpose == "batch" and uploaded.bytes > 0
    assert client.files.retrieve(uploaded.id).id == uploaded.id

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (40, 40, 0)
    assert done.error_file_id is None and done.completed_at is not None

    output = lines_of(client, done.output_file_id)
    assert [line["custom_id"] for line in output] == ids  # each once, in input order
    for line in output:
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["response"]["body"]["object"] == "chat.completion" and line["id"].startswith("batch_req_")
    assert len(recorded.seen) == 40
    assert all(seen.raw_path == b"/v1/chat/completions" for seen in recorded.seen)
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"


def test_lines_the_gateway_would_refuse_go_to_the_error_file(client_for, make_key, recorded) -> None:
    client = client_for(make_key(allowed_models=["tiny"]))
    lines = [chat_line("good"), chat_line("other-model", model="other"), chat_line("streams", stream=True),
             chat_line("unknown-field", bogus=1), {**chat_line("wrong-url"), "url": "/v1/completions"},
             chat_line("not-served", model="nope"), chat_line("good-2")]
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_for(client, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 5)
    assert [line["custom_id"] for line in lines_of(client, done.output_file_id)] == ["good", "good-2"]
    errors = {line["custom_id"]: line["response"] for line in lines_of(client, done.error_file_id)}
    assert errors["other-model"]["status_code"] == 403
    assert errors["streams"]["body"]["error"]["param"] == "stream"
    assert errors["unknown-field"]["body"]["error"]["code"] == "unknown_parameter"
    assert errors["wrong-url"]["body"]["error"]["param"] == "url"
    assert errors["not-served"]["body"]["error"]["code"] == "model_not_allowed"
    assert len(recorded.seen) == 2  # refused lines never reach the upstream


def test_a_file_that_cannot_be_a_batch_fails_it_naming_the_lines(client_for, make_key) -> None:
    client = client_for(make_key())
    lines = [chat_line("a"), {"method": "POST", "url": "/v1/chat/completions", "body": {}}, chat_line("a")]
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    failed = wait_for(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
    assert [(e.code, e.line) for e in failed.errors.data] == [("invalid_custom_id", 2), ("duplicate_custom_id", 3)]
