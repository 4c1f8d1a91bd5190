"""Property-based fuzzing of the gateway's request surface (hypothesis), over HTTP, against a
real gateway with a real redis-server and a recording upstream.

Properties, for any body (JSON objects with the sampling fields in any type, other JSON, or
raw bytes) on any of the OpenAI paths, with or without a key:
- the gateway never answers 5xx and never crashes;
- every body that reaches the upstream obeys the policy: max_tokens, n/best_of, top_logprobs
  within the stack's ceilings, no logit_bias, a max_tokens always present (the ceiling is
  added when the client sent none and the model's context would not bound the output),
  and `stream_options.include_usage` set on streams;
- every refusal is an OpenAI-shaped error.

And for any request target (served and unserved paths, percent-encoded up to three times in
either hex case, dot segments, case changes, doubled and trailing slashes, query strings) with
any method: the upstream request line is the canonical form of a served route, namely the
one the once-decoded target names, or nothing was sent.
"""

from __future__ import annotations

import http.client
import json
import string
from urllib.parse import unquote, urlsplit

import httpx
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from serving.gateway.http.app import create_app
from tests.support.hypothesis import examples
from tests.support.openai_fakes import settings_for
from tests.support.servers import serving

CEILING, MAX_N, MAX_TOP_LOGPROBS = 64, 2, 3
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/../admin", "/v1/%2e%2e/x"]
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []
        self.request_lines: list[str] = []  # method and target exactly as they arrived

    async def handle(self, request: Request) -> JSONResponse:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            body = raw  # not JSON: recorded as bytes, refused as vLLM would
        query = request.scope["query_string"]
        target = request.scope["raw_path"] + (b"?" + query if query else b"")
        self.request_lines.append(f"{request.method} {target.decode('latin-1')}")
        self.seen.append((request.url.path, body))
        if not isinstance(body, dict):
            return JSONResponse(
                {"error": {"message": "bad body", "type": "invalid_request_error", "code": None}}, status_code=400
            )
        return JSONResponse({"object": "x", "choices": [], "usage": USAGE})

    def app(self) -> Starlette:
        # Every path and method: whatever the gateway sends is recorded, served or not.
        return Starlette(
            routes=[Route("/{path:path}", self.handle, methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"])]
        )


@pytest.fixture(scope="module")
def recorder():
    return Recorder()


@pytest.fixture(scope="module")
def fuzzed_gateway(redis_server, recorder):
    upstream_settings = {
        "max_tokens_ceiling": CEILING,
        "max_n": MAX_N,
        "max_top_logprobs": MAX_TOP_LOGPROBS,
        "model_context_lengths": {"tiny": 4096},
        # vLLM extensions the policy bounds: allowed here so the fuzzing reaches those bounds
        "allowed_body_extensions": ["min_tokens", "prompt_logprobs"],
    }
    with serving(recorder.app()) as upstream:
        recorder.url = upstream
        app = create_app(settings_for(upstream, redis_server.url, **upstream_settings), RedisKeyStore(redis_server.url))
        with serving(app) as url:
            yield url


@pytest.fixture(scope="module")
def key(redis_server):
    return create_key_sync(
        redis_server.url,
        "fuzz",
        "fuzz",
        limits={
            "requests_per_minute": 1_000_000,
            "tokens_per_minute": 1_000_000_000,
            "daily_token_budget": 10**12,
            "max_concurrent_requests": 100,
        },
    )


# Any JSON value, small; and values that look like numbers in other types.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**20), 10**20) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
numberish = st.integers(-5, 10**6) | st.sampled_from(["5", "1e9", 5.0, True, None, [], {}]) | json_values
FIELDS = {
    "model": st.sampled_from(["tiny", "other", ""]) | json_values,
    "messages": st.just([{"role": "user", "content": "hi"}]) | json_values,
    "prompt": st.text(max_size=20) | json_values,
    "max_tokens": numberish,
    "max_completion_tokens": numberish,
    "min_tokens": numberish,
    "n": numberish,
    "best_of": numberish,
    "top_logprobs": numberish,
    "logprobs": numberish,
    "prompt_logprobs": numberish,
    "logit_bias": st.just({})
    | st.dictionaries(st.text(string.digits, min_size=1, max_size=4), st.integers(-100, 100), max_size=3)
    | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.just({"include_usage": False}) | json_values,
}
bodies = (
    st.fixed_dictionaries({}, optional=FIELDS).map(lambda d: json.dumps(d).encode())
    | json_values.map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=64)
)


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def assert_obeys_policy(path: str, body: dict | list | bytes) -> None:
    if path not in ("/v1/chat/completions", "/v1/completions"):
        return
    assert isinstance(body, dict), body  # completions bodies must be JSON objects
    output = [_int(body.get(f)) for f in ("max_tokens", "max_completion_tokens", "min_tokens")]
    assert all(v is None or v <= CEILING for v in output), body
    # A bound on the output is always sent, but for a completion within vLLM's own default of 16.
    assert any(v is not None for v in output[:2]) or (path == "/v1/completions" and CEILING >= 16), body
    assert all(_int(body.get(f)) is None or _int(body.get(f)) <= MAX_N for f in ("n", "best_of")), body
    assert _int(body.get("top_logprobs")) is None or body["top_logprobs"] <= MAX_TOP_LOGPROBS, body
    assert not body.get("logit_bias"), body
    if body.get("stream") is True:
        assert body["stream_options"]["include_usage"] is True, body


def check_request(
    fuzzed_gateway: str, recorder: Recorder, key: str, path: str, body: bytes, with_key: bool, method: str
) -> list[tuple[str, dict]]:
    """One request through `gateway`, checked: no 5xx, OpenAI-shaped refusals, and whatever
    reached the upstream obeys the policy. Returns what reached the upstream."""
    recorder.seen.clear()
    headers = {"Authorization": f"Bearer {key}"} if with_key else {}
    response = httpx.request(
        method,
        f"{fuzzed_gateway}{path}",
        content=body if method == "POST" else None,
        headers={**headers, "content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert set(response.json()["error"]) >= {"message", "type", "code"}
    if not with_key:  # 404/405: a route not served (or not with this method), refused before the key check
        assert response.status_code in (401, 404, 405) and not recorder.seen
    for upstream_path, upstream_body in recorder.seen:
        assert_obeys_policy(upstream_path, upstream_body)
    return list(recorder.seen)


def output_bound_added(sent: bytes, forwarded: list[tuple[str, dict]]) -> bool:
    """The client named no output bound, and the gateway added its ceiling on the way."""
    try:
        body = json.loads(sent)
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and body.get("max_tokens") is None
        and body.get("max_completion_tokens") is None
        and any(isinstance(b, dict) and b.get("max_tokens") == CEILING for _, b in forwarded)
    )


def test_any_request_gets_no_5xx_and_nothing_forbidden_reaches_the_upstream(fuzzed_gateway, recorder, key):
    tally = {"requests": 0, "forwarded": 0, "bound_added": 0}

    @settings(max_examples=examples(fast=100, deep=300))
    @given(path=st.sampled_from(PATHS), body=bodies, with_key=st.booleans(), method=st.sampled_from(["POST", "GET"]))
    @example(
        path="/v1/chat/completions",
        method="POST",
        with_key=True,
        body=json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode(),
    )
    def any_request(path, body, with_key, method):
        forwarded = check_request(fuzzed_gateway, recorder, key, path, body, with_key, method)
        tally["requests"] += 1
        tally["forwarded"] += bool(forwarded)
        tally["bound_added"] += output_bound_added(body, forwarded)

    any_request()
    # The property says nothing if nothing reaches the upstream (every request a 401, say).
    assert tally["forwarded"] >= 1 and tally["bound_added"] >= 1, tally
    assert tally["forwarded"] < tally["requests"], tally  # and some were refused


def test_fuzzing_can_fail(recorder, key):
    """The check above must be able to fail: a body the policy forbids, sent straight to the
    upstream recorder (a gateway that enforces nothing), is caught by the same check."""
    for body in (
        {"model": "tiny", "max_tokens": CEILING + 1},
        {"model": "tiny", "max_tokens": 5, "logit_bias": {"1": 1}},
        {"model": "tiny", "messages": []},
    ):  # no output bound
        with pytest.raises(AssertionError):
            check_request(recorder.url, recorder, key, "/v1/chat/completions", json.dumps(body).encode(), True, "POST")


# --- request targets ---------------------------------------------------------------------------------

SERVED = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/tiny"),
    ("GET", "/v1/models/other"),
}
BASES = [path for _, path in sorted(SERVED)] + [
    "/tokenize",
    "/detokenize",
    "/v1/score",
    "/openapi.json",
    "/-/routes",
    "/docs",
    "/v1/audio/transcriptions",
    "/metrics",
    "/readyz",
]
BODIES = {
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    "/v1/completions": {"model": "tiny", "prompt": "hi", "max_tokens": 5},
    "/v1/embeddings": {"model": "tiny", "input": "hi"},
}


def percent(char: str, depth: int, upper: bool) -> str:
    """`char` percent-encoded `depth` times: c -> %63 -> %2563 -> %252563."""
    encoded = f"%{ord(char):02X}" if upper else f"%{ord(char):02x}"
    for _ in range(depth - 1):
        encoded = "%25" + encoded[1:]
    return encoded


@st.composite
def targets(draw) -> str:
    base = draw(st.sampled_from(BASES))
    rate = draw(st.sampled_from([0, 0, 1, 3]))  # how hard to mangle it: 0 keeps it clean, so some get served
    if rate == 0:
        return base + draw(st.sampled_from(["", "", "/", "?x=1", "?a=%2e%2e&b=/../x"]))
    segments = base.split("/")[1:]
    out = []
    for segment in segments:
        if draw(st.integers(0, 5 * rate)) == 0:  # a dot segment before this one, maybe encoded
            dots = draw(st.sampled_from([".", ".."]))
            depth = draw(st.integers(0, 3))
            out.append("".join(percent(".", depth, draw(st.booleans())) if depth else "." for _ in dots))
        chars = []
        for char in segment:
            depth = draw(st.integers(0, 3)) if draw(st.integers(0, 6 // rate)) == 0 else 0
            if depth:
                chars.append(percent(char, depth, draw(st.booleans())))
            else:
                chars.append(char.upper() if draw(st.integers(0, 30 // rate)) == 0 else char)
        out.append("".join(chars))
    slash = draw(st.sampled_from(["/", "/", "/", "//", "%2F", "%2f", "%252F"]))
    target = "/" + slash.join(out) if draw(st.integers(0, 3)) else "/" + "/".join(out)
    target += draw(st.sampled_from(["", "", "", "/", "//", "/.", "%2F", "?", "?x=1", "?a=%2e%2e&b=/../x", "#f"]))
    return target


def send(base_url: str, method: str, target: str, key: str) -> int:
    """The request with `target` byte for byte (http.client does not normalize it)."""
    decoded = unquote(target.split("?")[0].split("#")[0])
    body = json.dumps(BODIES.get(decoded, BODIES["/v1/chat/completions"])).encode() if method == "POST" else None
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request(
            method, target, body=body, headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        )
        return connection.getresponse().status
    finally:
        connection.close()


METHODS = ["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH", "post", "Get", "TRACE"]


def method_for(target: str) -> st.SearchStrategy[str]:
    """Half the time the method the target's route takes (so some requests are served), else any."""
    decoded = unquote(target.split("?")[0].split("#")[0])
    own = "POST" if decoded in BODIES else "GET"
    return st.just(own) | st.sampled_from(METHODS)


def check_target(fuzzed_gateway: str, recorder: Recorder, key: str, method: str, target: str) -> bool:
    """One request with `target` through `gateway`, checked: no 5xx, and the upstream saw the
    canonical form of a served route, the one the once-decoded target names, or nothing.
    Returns whether it was forwarded."""
    recorder.request_lines.clear()
    recorder.seen.clear()
    status = send(fuzzed_gateway, method, target, key)
    assert status < 500, (method, target, status)
    if not recorder.request_lines:
        return False
    (line,) = recorder.request_lines
    sent_method, sent_target = line.split(" ", 1)
    assert (sent_method, sent_target) in SERVED, (method, target, line)
    # ...and it is the route the target names once decoded (as uvicorn decodes it), not another
    assert (sent_method, sent_target) == (method, unquote(target.split("?")[0].split("#")[0])), (method, target, line)
    return True


def test_the_upstream_sees_the_canonical_form_of_a_served_route_or_nothing(fuzzed_gateway, recorder, key):
    tally = {"requests": 0, "forwarded": 0}

    @settings(max_examples=examples(fast=200, deep=600))
    @given(request=targets().flatmap(lambda target: st.tuples(method_for(target), st.just(target))))
    @example(request=("POST", "/v1/chat/completions"))
    @example(request=("GET", "/v1/models/%74iny"))  # encoded once: served as /v1/models/tiny
    def any_target(request):
        method, target = request
        tally["requests"] += 1
        forwarded = check_target(fuzzed_gateway, recorder, key, method, target)
        event("forwarded" if forwarded else "refused")
        tally["forwarded"] += forwarded

    any_target()
    assert 2 <= tally["forwarded"] < tally["requests"], tally  # both outcomes were exercised


def test_path_fuzzing_can_fail(recorder, key):
    """The check above must see what the old gateway did: a target passed on still encoded (then
    decoded again upstream). Sent straight to the recorder, a gateway that normalizes nothing."""
    with pytest.raises(AssertionError):
        check_target(recorder.url, recorder, key, "GET", "/v1/%2e%2e/tokenize")
    with pytest.raises(AssertionError):
        check_target(recorder.url, recorder, key, "GET", "/v1/models/%2574iny")  # decoded twice: /v1/models/tiny
