"""The one bounded parse of a request body (serving.gateway.admission.body), and what a body may carry:
OpenAI's fields, plus only the vLLM extensions the stack allows. Unit and property tests of the
pure functions, then the attacks through a real gateway.
"""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from serving.gateway.admission.body import BodyError, nesting_within, parse_json, request_document
from serving.gateway.config.settings import GatewaySettings
from serving.gateway.protocol.routes import CHAT_FIELDS, COMPLETION_FIELDS, EMBEDDING_FIELDS
from tests.support.hypothesis import examples

DEPTH = 32
SETTINGS = GatewaySettings(upstream_url="http://upstream:8000")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def parse(body: bytes, max_depth: int = DEPTH):
    return parse_json(body, max_bytes=1_000_000, max_depth=max_depth)


# --- the parse ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 100_000 + b"]" * 100_000,  # deep enough for RecursionError in json.loads
        b"[" * 100_000,  # unclosed
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b"[" * 33 + b"]" * 33,
        b'{"messages": ' + b"[" * 40 + b"]" * 40 + b"}",
    ],
)
def test_deep_nesting_is_a_body_error_never_a_recursion_error(body):
    result = parse(body)
    assert isinstance(result, BodyError) and result.code in ("json_too_deep", "invalid_json")


def test_the_depth_bound_is_exact():
    assert parse(b"[" * DEPTH + b"]" * DEPTH) is not None
    assert not isinstance(parse(b"[" * DEPTH + b"]" * DEPTH), BodyError)
    assert parse(b"[" * (DEPTH + 1) + b"]" * (DEPTH + 1)).code == "json_too_deep"


def test_brackets_inside_strings_do_not_count():
    body = json.dumps({"content": "[" * 10_000 + '\\"{' * 100}).encode()
    assert parse(body) == {"content": "[" * 10_000 + '\\"{' * 100}


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"max_tokens": 1, "max_tokens": 100000}', "invalid_json"),  # read two ways by two parsers: refused
        (b'{"temperature": NaN}', "invalid_json"),
        (b'{"temperature": Infinity}', "invalid_json"),
        (b'{"model": "\xff"}', "invalid_json"),  # not UTF-8
        (b"\xef\xbb\xbf{}", "invalid_json"),  # a BOM
        ('{"a": 1}'.encode("utf-16"), "invalid_json"),  # json.loads(bytes) would accept UTF-16; the upstream too
        (b"1" * 5000, "invalid_json"),  # past Python's int digit limit
        (b"", "invalid_json"),
        (b"{" + b" " * 2_000_000 + b"}", "request_too_large"),
    ],
)
def test_strict_json_only(body, code):
    result = parse(body)
    assert isinstance(result, BodyError) and result.code == code, result


json_documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)


def depth_of(value) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


@settings(max_examples=examples(fast=100, deep=300))
@given(document=json_documents, max_depth=st.integers(2, 8))
def test_parse_agrees_with_json_within_the_bound(document, max_depth):
    body = json.dumps(document, ensure_ascii=False).encode()
    result = parse(body, max_depth)
    if depth_of(document) <= max_depth:
        assert result == document
    else:
        assert isinstance(result, BodyError) and result.code == "json_too_deep"


@settings(max_examples=examples(fast=150, deep=500))
@given(body=st.text(alphabet='[]{}",:\\ 1a', max_size=400).map(str.encode) | st.binary(max_size=200))
def test_parse_never_raises_on_junk(body):
    result = parse(body, 4)
    if not isinstance(result, BodyError):
        assert depth_of(result) <= 4


@settings(max_examples=examples(fast=150, deep=500))
@given(body=st.text(alphabet="[]{}", max_size=300).map(str.encode), max_depth=st.integers(1, 10))
def test_nesting_within_matches_a_simple_counter(body, max_depth):
    """The bound a recursive parser needs: how many brackets are open at once, objects and arrays
    alike (a parser stops at the first mismatch, so types do not matter for the bound)."""
    open_now, deepest, paired = 0, 0, True
    for byte in body:
        open_now += 1 if byte in b"[{" else -1
        deepest = max(deepest, open_now)
        paired = paired and open_now >= 0
    paired = paired and open_now == 0
    openers = body.count(b"[") + body.count(b"{")
    result = nesting_within(body, max_depth)
    if openers <= max_depth:
        assert result is True
    elif paired:
        assert result is (deepest <= max_depth)
    else:
        assert result in (None, False)


# --- fields -------------------------------------------------------------------------------------


def test_openai_field_lists_match_the_openai_sdk():
    import typing

    from openai.types import completion_create_params, embedding_create_params
    from openai.types.chat import completion_create_params as chat_params

    def fields(params) -> set[str]:
        return set(typing.get_type_hints(params))

    assert CHAT_FIELDS == fields(chat_params.CompletionCreateParamsBase) | {"stream"}
    assert COMPLETION_FIELDS == fields(completion_create_params.CompletionCreateParamsBase) | {"stream"}
    assert EMBEDDING_FIELDS == fields(embedding_create_params.EmbeddingCreateParams)


@pytest.mark.parametrize(
    "field",
    [
        "priority",
        "request_id",
        "chat_template",
        "kv_transfer_params",
        "ignore_eos",
        "top_k",
        "min_tokens",
        "logits_processors",
        "cache_salt",
        "Model",
    ],
)
def test_fields_beyond_openai_are_refused_by_default(field):
    result = request_document(json.dumps({**CHAT, field: 1}).encode(), "/v1/chat/completions", SETTINGS)
    assert isinstance(result, BodyError) and result.code == "unknown_parameter" and result.param == field


def test_the_stack_can_allow_extensions_but_never_engine_internals():
    settings = SETTINGS.model_copy(update={"allowed_body_extensions": ["top_k", "ignore_eos"]})
    body = json.dumps({**CHAT, "top_k": 5, "ignore_eos": True}).encode()
    assert request_document(body, "/v1/chat/completions", settings) == {**CHAT, "top_k": 5, "ignore_eos": True}
    for internal in ("request_id", "kv_transfer_params", "chat_template", "logits_processors"):
        with pytest.raises(ValidationError, match=internal):
            GatewaySettings(upstream_url="http://u:1", allowed_body_extensions=[internal])


def test_get_routes_take_no_body():
    assert request_document(b"", "/v1/models", SETTINGS) is None
    assert request_document(b"{}", "/v1/models", SETTINGS).code == "unexpected_body"


# --- through the gateway -------------------------------------------------------------------------


def post(raw, gateway: str, key: str, body: bytes, path: str = "/v1/chat/completions"):
    status, _, answer = raw(
        gateway, "POST", path, body=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    )
    return status, json.loads(answer)


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "tiny", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b'{"model": "tiny", "messages": [{"content": ' + b"[" * 30_000 + b"}",
        b'{"model": "tiny", "max_tokens": 1, "max_tokens": 100000, "messages": []}',
        b'{"model": "tiny", "messages": [], "temperature": NaN}',
    ],
)
def test_hostile_bodies_are_400_not_500_and_never_reach_the_upstream(start_gateway, recorded, key, raw, body):
    with start_gateway(max_body_bytes=1_000_000) as (gateway, _):
        status, answer = post(raw, gateway, key, body)
    assert status == 400 and answer["error"]["type"] == "invalid_request_error"
    assert recorded.seen == []


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("priority", -1000),
        ("request_id", "another-tenants-request"),
        ("kv_transfer_params", {"do_remote_decode": True}),
        ("chat_template", "{{ cycler.__init__.__globals__ }}"),
        ("ignore_eos", True),
        ("vllm_xargs", {"a": 1}),
    ],
)
def test_vllm_extension_fields_are_refused_unless_the_stack_allows_them(gateway, recorded, key, raw, field, value):
    status, answer = post(raw, gateway, key, json.dumps({**CHAT, field: value}).encode())
    assert status == 400 and answer["error"]["code"] == "unknown_parameter" and answer["error"]["param"] == field
    assert recorded.seen == []


def test_an_allowed_extension_passes(start_gateway, recorded, key, raw):
    with start_gateway(allowed_body_extensions=["ignore_eos"]) as (gateway, _):
        status, _ = post(raw, gateway, key, json.dumps({**CHAT, "max_tokens": 5, "ignore_eos": True}).encode())
    assert status == 200 and json.loads(recorded.seen[-1].body)["ignore_eos"] is True


@pytest.mark.parametrize("junk", ["", string.ascii_letters])
def test_a_body_that_is_not_a_json_object_is_refused_on_every_post_route(gateway, recorded, key, raw, junk):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        status, answer = post(raw, gateway, key, (junk or "[1, 2]").encode(), path)
        assert status == 400, (path, answer)
    assert recorded.seen == []
