"""The Batch API through the official `openai` client, against a real gateway and redis-server:
upload, create, poll, download; cancel; expiry; tenants that cannot see each other's work."""

from __future__ import annotations

import json
import tempfile
import time

import openai
import pytest
from openai.types import FileObject

from tests.support.batches import batch_reaching
from tests.support.servers import HANG_BOUND_S


def chat_line(custom_id: str, model: str = "tiny", **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": model, "messages": [{"role": "user", "content": f"say {custom_id}"}], **body},
    }


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


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

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "nightly"}
    )
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = batch_reaching(client, batch.id, {"completed", "failed"})
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
    lines = [
        chat_line("good"),
        chat_line("other-model", model="other"),
        chat_line("streams", stream=True),
        chat_line("unknown-field", bogus=1),
        {**chat_line("wrong-url"), "url": "/v1/completions"},
        chat_line("not-served", model="nope"),
        chat_line("good-2"),
    ]
    uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_reaching(client, batch.id, {"completed", "failed"})
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
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    failed = batch_reaching(client, batch.id, {"failed", "completed"})
    assert failed.status == "failed" and failed.errors is not None and failed.errors.data is not None
    assert [(e.code, e.line) for e in failed.errors.data] == [("invalid_custom_id", 2), ("duplicate_custom_id", 3)]


def slow(seen) -> object:
    """The recording upstream's usual answer, after a pause (it answers one request at a time)."""
    from tests.support.gateway import default_answer

    time.sleep(0.05)
    return default_answer(seen)


def test_cancel_stops_new_lines_and_finalizes_what_completed(client_for, make_key, recorded) -> None:
    recorded.answer = slow
    client = client_for(make_key())
    ids = [f"c-{n}" for n in range(200)]
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in ids])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + HANG_BOUND_S
    while (client.batches.retrieve(batch.id).request_counts.completed or 0) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    cancelled = batch_reaching(client, batch.id, {"cancelled"})
    assert cancelled.status == "cancelled" and cancelled.cancelled_at is not None
    counts = cancelled.request_counts
    assert counts is not None and counts.total == 200 and 5 <= counts.completed < 200
    output, errors = lines_of(client, cancelled.output_file_id), lines_of(client, cancelled.error_file_id)
    assert sorted(line["custom_id"] for line in output + errors) == sorted(ids)  # each exactly once
    assert {line["error"]["code"] for line in errors} == {"batch_cancelled"}
    assert len(output) == counts.completed
    sent = len(recorded.seen)
    time.sleep(1)  # several sweeps and worker turns: nothing of the batch starts any more
    assert len(recorded.seen) == sent
    assert client.batches.cancel(batch.id).status == "cancelled"  # cancelling again is no error


def test_a_batch_past_its_window_expires_and_its_unfinished_lines_fail(start_gateway, make_key, recorded) -> None:
    recorded.answer = slow
    with start_gateway(batch={"completion_window_s": 1}) as (api, _):
        client = openai.OpenAI(base_url=f"{api}/v1", api_key=make_key(), max_retries=0, timeout=HANG_BOUND_S)
        ids = [f"e-{n}" for n in range(200)]
        uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line(i) for i in ids])), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.expires_at is not None and batch.expires_at - batch.created_at == 1
        expired = batch_reaching(client, batch.id, {"expired", "completed"})
        output, errors = lines_of(client, expired.output_file_id), lines_of(client, expired.error_file_id)
    assert expired.status == "expired" and expired.expired_at is not None
    counts = expired.request_counts
    assert counts is not None and counts.completed + counts.failed == 200 and counts.failed > 0
    assert sorted(line["custom_id"] for line in output + errors) == sorted(ids)
    assert {line["error"]["code"] for line in errors} == {"batch_expired"}


def test_another_tenants_key_sees_nothing(client_for, make_key) -> None:
    owner, other = client_for(make_key("owner-co")), client_for(make_key("other-co"))
    uploaded = owner.files.create(file=("in.jsonl", jsonl([chat_line("x")])), purpose="batch")
    batch = owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_reaching(owner, batch.id, {"completed"})
    assert done.output_file_id is not None
    for call in (
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.files.retrieve(uploaded.id),
        lambda: other.files.content(uploaded.id),
        lambda: other.files.content(done.output_file_id),
        lambda: other.files.delete(uploaded.id),
        lambda: other.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert [b.id for b in other.batches.list()] == []
    assert owner.files.content(uploaded.id).content == jsonl([chat_line("x")])  # untouched by the attempts


def test_list_is_newest_first_with_openai_cursor_pagination(client_for, make_key) -> None:
    client = client_for(make_key("pager-co"))
    uploaded = client.files.create(file=("in.jsonl", jsonl([chat_line("x")])), purpose="batch")
    made = [
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2] and first.has_more
    assert [b.id for b in client.batches.list(limit=2, after=first.data[-1].id).data] == made[:1]
    assert [b.id for b in client.batches.list(limit=2)] == made[::-1]  # the SDK's own auto-pagination


def test_files_list_like_openai_and_only_the_tenants_own(client_for, make_key) -> None:
    client, other = client_for(make_key("lister-co")), client_for(make_key("nosy-co"))
    made = [
        client.files.create(file=(f"in{i}.jsonl", jsonl([chat_line(str(i))])), purpose="batch").id for i in range(3)
    ]
    other.files.create(file=("theirs.jsonl", jsonl([chat_line("t")])), purpose="batch")
    first = client.files.list(limit=2)
    assert [f.id for f in first.data] == made[::-1][:2] and first.has_more
    assert [f.id for f in client.files.list(limit=2, after=first.data[-1].id).data] == made[:1]
    assert [f.id for f in client.files.list(limit=2)] == made[::-1]  # the SDK's own auto-pagination
    assert [f.id for f in client.files.list(order="asc")] == made
    assert [f.id for f in other.files.list()] != [] and not set(made) & {f.id for f in other.files.list()}
    client.files.delete(made[1])
    assert [f.id for f in client.files.list()] == [made[2], made[0]]  # a deleted file is not listed
    batch = client.batches.create(input_file_id=made[0], endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_reaching(client, batch.id, {"completed"})
    assert [f.id for f in client.files.list(purpose="batch_output")] == [done.output_file_id]
    assert [f.id for f in client.files.list(purpose="batch")] == [made[2], made[0]]
    assert all(isinstance(f, FileObject) for f in client.files.list())


def test_a_spent_daily_budget_stops_the_batch_and_fails_the_rest(client_for, redis_server, recorded) -> None:
    from serving.gateway.auth.keys import create_key_sync
    from tests.support.gateway import GENEROUS

    key = create_key_sync(redis_server.url, "thrifty-co", "budget", limits={**GENEROUS, "daily_token_budget": 1000})
    client = client_for(key)
    ids = [f"b-{n}" for n in range(60)]
    uploaded = client.files.create(
        file=("in.jsonl", jsonl([chat_line(i, max_tokens=10) for i in ids])), purpose="batch"
    )
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_reaching(client, batch.id, {"completed", "failed"})
    assert done.status == "completed" and done.request_counts is not None
    assert 0 < done.request_counts.completed < 60 and done.request_counts.failed > 0
    output, errors = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert sorted(line["custom_id"] for line in output + errors) == sorted(ids)
    assert {line["error"]["code"] for line in errors if line["error"]} == {"daily_token_budget_exceeded"}
    assert "daily token budget" in errors[-1]["error"]["message"]
    assert len(recorded.seen) == len(output)  # billed and sent: only what completed


def test_a_file_of_several_megabytes_round_trips_byte_for_byte(client_for, make_key, monkeypatch) -> None:
    # Larger than Starlette's 1 MB spool: the gateway keeps uploads in memory (its pod's root
    # filesystem is read-only). The gateway runs in this process: with no usable temporary
    # folder, a form file spooled to disk would fail the upload.
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/llmstack-no-tmp")
    client = client_for(make_key())
    content = jsonl([chat_line(f"big-{n}", user="x" * 200) for n in range(8000)])
    assert len(content) > 2_000_000
    uploaded = client.files.create(file=("big.jsonl", content), purpose="batch")
    assert uploaded.bytes == len(content) and uploaded.filename == "big.jsonl"
    assert client.files.content(uploaded.id).content == content
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)
