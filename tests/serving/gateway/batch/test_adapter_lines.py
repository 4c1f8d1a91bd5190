"""Batch lines naming LoRA adapters (the gateway's Batch API, real redis-server, the openai
client): a line naming an adapter its key may not use fails exactly like one naming an unknown
model, at create and never upstream; a granted adapter's line runs on its base's route."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.support.batches import batch_reaching
from tests.support.servers import HANG_BOUND_S

ADAPTERS = {"tiny": ["sql", "pirate"]}


@pytest.fixture(scope="module")
def adapters_gateway(start_gateway) -> Iterator[str]:
    with start_gateway(model_adapters=ADAPTERS, model_routes={"tiny": "/tiny"}) as (api, _):
        yield api


def line(custom_id: str, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_a_line_naming_a_forbidden_adapter_fails_like_an_unknown_model(adapters_gateway, make_key, recorded) -> None:
    client = openai.OpenAI(
        base_url=f"{adapters_gateway}/v1",
        api_key=make_key("lora-batch", allowed_adapters=["tiny:sql"]),
        max_retries=0,
        timeout=HANG_BOUND_S,
    )
    lines = [
        line("granted", "tiny:sql"),
        line("forbidden", "tiny:pirate"),
        line("unserved", "tiny:nope"),
        line("spelled", "tiny:sql "),
        line("unknown", "nonexistent"),
    ]
    content = "".join(json.dumps(x) + "\n" for x in lines).encode()
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    done = batch_reaching(client, batch.id, {"completed", "failed"})
    assert done.status == "completed"
    assert [x["custom_id"] for x in lines_of(client, done.output_file_id)] == ["granted"]
    errors = {x["custom_id"]: x["response"] for x in lines_of(client, done.error_file_id)}
    assert set(errors) == {"forbidden", "unserved", "spelled", "unknown"}
    unknown = errors.pop("unknown")
    for custom_id, response in errors.items():
        name = next(x["body"]["model"] for x in lines if x["custom_id"] == custom_id)
        assert response["status_code"] == unknown["status_code"] == 404, custom_id
        expected = unknown["body"]["error"]["message"].replace(repr("nonexistent"), repr(name))
        assert response["body"]["error"] == {**unknown["body"]["error"], "message": expected}, custom_id
    (seen,) = recorded.seen
    assert seen.raw_path == b"/tiny/v1/chat/completions" and json.loads(seen.body)["model"] == "tiny:sql"
