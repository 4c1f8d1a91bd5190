"""The input file's checks, called directly: what fails the whole batch, what fails one line."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from serving.gateway.auth.key_format import KeyRecord
from serving.gateway.batch.lines import check_input
from serving.gateway.config.settings import GatewaySettings

SETTINGS = GatewaySettings(upstream_url="http://upstream:8000", models=["tiny", "other"], max_body_bytes=4096)
FIVE_LINES = SETTINGS.model_copy(update={"batch": SETTINGS.batch.model_copy(update={"max_lines": 5})})
KEY = KeyRecord(key_id="k1", tenant="acme", name="t", created_at=datetime.now(timezone.utc))
CHAT = "/v1/chat/completions"


def line(custom_id: object, **changes) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        **changes,
    }


def jsonl(*lines: object) -> bytes:
    return "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines).encode()


def test_good_lines_keep_their_order_and_become_the_body_sent() -> None:
    checked = check_input(jsonl(line("b"), "", line("a")), CHAT, KEY, SETTINGS)
    assert [(x.number, x.custom_id) for x in checked.lines] == [(1, "b"), (3, "a")]
    assert json.loads(checked.lines[0].body) == line("b")["body"]
    assert checked.custom_ids == ["b", "a"] and checked.problems == [] and checked.rejected == []


def test_file_level_problems_name_their_lines() -> None:
    checked = check_input(
        jsonl(line("a"), "{not json", "[1]", line(""), line(7), line("x" * 513), line("a")), CHAT, KEY, FIVE_LINES
    )
    assert [(p.code, p.line) for p in checked.problems] == [
        ("invalid_json_line", 2),
        ("invalid_json_line", 3),
        ("invalid_custom_id", 4),
        ("invalid_custom_id", 5),
        ("too_many_requests", 6),
    ]
    assert [(p.code, p.line) for p in check_input(jsonl(line("a"), line("a")), CHAT, KEY, SETTINGS).problems] == [
        ("duplicate_custom_id", 2)
    ]
    assert [p.code for p in check_input(b"\xff", CHAT, KEY, SETTINGS).problems] == ["invalid_file_format"]
    assert [p.code for p in check_input(b"\n \n", CHAT, KEY, SETTINGS).problems] == ["empty_file"]


def test_lines_admission_would_refuse_get_its_answer() -> None:
    restricted = KEY.model_copy(update={"allowed_models": ["tiny"]})
    body = line("x")["body"]
    cases = {
        "method": line("method", method="GET"),
        "url": line("url", url="/v1/completions"),
        "extra": line("extra", priority=1),
        "body-not-object": line("body-not-object", body=[1]),
        "unknown-field": line("unknown-field", body={**body, "priority": 0}),
        "stream": line("stream", body={**body, "stream": True}),
        "forbidden-model": line("forbidden-model", body={**body, "model": "other"}),
        "no-model": line("no-model", body={"messages": body["messages"]}),
        "policy": line("policy", body={**body, "max_tokens": 10**9}),
        "too-big": line("too-big", body={**body, "messages": [{"role": "user", "content": "x" * 5000}]}),
    }
    checked = check_input(jsonl(*cases.values()), CHAT, restricted, SETTINGS)
    answers = {r.custom_id: (r.status, r.body["error"]["code"], r.body["error"]["param"]) for r in checked.rejected}
    assert answers == {
        "method": (400, "invalid_value", "method"),
        "url": (400, "invalid_url", "url"),
        "extra": (400, "unknown_parameter", "priority"),
        "body-not-object": (400, "invalid_request_body", "body"),
        "unknown-field": (400, "unknown_parameter", "priority"),
        "stream": (400, "invalid_value", "stream"),
        "forbidden-model": (403, "model_not_allowed", "model"),
        "no-model": (403, "model_not_allowed", "model"),
        "policy": (400, "integer_above_max_value", "max_tokens"),  # as the online path answers it
        "too-big": (400, "request_too_large", None),
    }
    assert checked.lines == [] and checked.problems == []
    unserved = check_input(jsonl(line("u", body={**body, "model": "nope"})), CHAT, KEY, SETTINGS)
    assert [(r.status, r.body["error"]["code"]) for r in unserved.rejected] == [(404, "model_not_found")]
