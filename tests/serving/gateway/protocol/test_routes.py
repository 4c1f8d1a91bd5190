"""Routing: only the allowlisted OpenAI routes are served, and the upstream receives exactly the
canonical path that was checked. Written as the attacks: each request goes over a socket byte
for byte, through a real gateway, to an upstream that records every request line it gets.
"""

from __future__ import annotations

import json

import pytest

from serving.gateway.config.settings import GatewaySettings
from serving.gateway.protocol.routes import ApiRoute, RouteRefusal, is_canonical, resolve, upstream_prefix_for

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
FILE = "file-0123456789abcdef01234567"
BATCH = "batch_0123456789abcdef01234567"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


# --- the pure decision -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("POST", "/v1/chat/completions", ApiRoute("POST", "/v1/chat/completions")),
        ("POST", "/v1/completions", ApiRoute("POST", "/v1/completions")),
        ("POST", "/v1/embeddings", ApiRoute("POST", "/v1/embeddings")),
        ("GET", "/v1/models", ApiRoute("GET", "/v1/models")),
        ("GET", "/v1/models/tiny", ApiRoute("GET", "/v1/models/tiny", model="tiny")),
        ("GET", "/v1/chat/completions", RouteRefusal(405, ("POST",))),
        ("post", "/v1/chat/completions", RouteRefusal(405, ("POST",))),
        ("HEAD", "/v1/models", RouteRefusal(405, ("GET",))),
        ("GET", "/v1/models/nope", RouteRefusal(404)),
        ("GET", "/v1/models/", RouteRefusal(404)),
        ("POST", "/v1/chat/completions/", RouteRefusal(404)),
        ("POST", "/V1/chat/completions", RouteRefusal(404)),
        ("POST", "/v1//chat/completions", RouteRefusal(404)),
        ("POST", "/v1/%63hat/completions", RouteRefusal(404)),
        ("GET", "/v1/../tokenize", RouteRefusal(404)),
        ("POST", "/tokenize", RouteRefusal(404)),
        ("POST", "/v1/score", RouteRefusal(404)),
        ("POST", "/v1/audio/transcriptions", RouteRefusal(404)),
        # The Batch API: the gateway's own handlers, ids only in the exact form the gateway makes them.
        ("POST", "/v1/files", ApiRoute("POST", "/v1/files", handler="files.create")),
        ("GET", f"/v1/files/{FILE}", ApiRoute("GET", f"/v1/files/{FILE}", handler="files.retrieve", resource=FILE)),
        ("DELETE", f"/v1/files/{FILE}", ApiRoute("DELETE", f"/v1/files/{FILE}", handler="files.delete", resource=FILE)),
        (
            "GET",
            f"/v1/files/{FILE}/content",
            ApiRoute("GET", f"/v1/files/{FILE}/content", handler="files.content", resource=FILE),
        ),
        ("GET", "/v1/batches", ApiRoute("GET", "/v1/batches", handler="batches.list")),
        (
            "POST",
            f"/v1/batches/{BATCH}/cancel",
            ApiRoute("POST", f"/v1/batches/{BATCH}/cancel", handler="batches.cancel", resource=BATCH),
        ),
        ("GET", "/v1/files", ApiRoute("GET", "/v1/files", handler="files.list")),
        ("PUT", "/v1/files", RouteRefusal(405, ("GET", "POST"))),
        ("PUT", f"/v1/batches/{BATCH}", RouteRefusal(405, ("GET",))),
        ("GET", f"/v1/files/{FILE.upper()}", RouteRefusal(404)),
        ("GET", f"/v1/files/{FILE}0", RouteRefusal(404)),
        ("GET", f"/v1/files/{BATCH}", RouteRefusal(404)),
        ("GET", f"/v1/batches/{FILE}", RouteRefusal(404)),
        ("GET", f"/v1/files/{FILE}/content/", RouteRefusal(404)),
        ("GET", f"/v1/files/{FILE}/../{FILE}", RouteRefusal(404)),
        ("GET", f"/v1/files/%66{FILE[1:]}", RouteRefusal(404)),  # uvicorn decodes once; a `%` left means twice
    ],
)
def test_resolve(method, path, expected):
    route = resolve(method, path, ["tiny", "other"])
    if isinstance(expected, ApiRoute):
        assert (route.method, route.path, route.model) == (expected.method, expected.path, expected.model)
    else:
        assert route == expected


@pytest.mark.parametrize(
    "path",
    [
        "/v1/%2e%2e/x",
        "/v1/./models",
        "/v1/..",
        "/v1/a\\b",
        "/v1/m\u00e9",
        "/v1/a b",
        "/v1/models?x",
        "/v1/models#x",
        "v1/models",
        "/v1/models/",
    ],
)
def test_not_canonical(path):
    assert not is_canonical(path)


# --- through the gateway -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "/v1/%2563hat/completions",  # decoded once by uvicorn to /v1/%63hat/..., once more by yarl
        "/v1/%252563hat/completions",  # triple
        "/v1/%2563HAT/completions",
        "/v1/chat%252Fcompletions",
    ],
)
def test_a_twice_encoded_completion_path_is_404_and_never_reaches_the_upstream(gateway, recorded, key, raw, target):
    body = json.dumps({**CHAT, "max_tokens": 1_000_000, "n": 64}).encode()  # over every completions rule
    status, _, answer = raw(gateway, "POST", target, headers=auth(key), body=body)
    assert status == 404 and json.loads(answer)["error"]["code"] == "unknown_url"
    assert recorded.seen == []


@pytest.mark.parametrize(
    "target",
    [
        "/v1/%252e%252e/tokenize",
        "/v1/%252E%252E/tokenize",
        "/v1/%25252e%25252e/tokenize",
        "/v1/..%252Ftokenize",
        "/v1/%2e%2e/tokenize",
        "/v1/../tokenize",
        "/v1/./models",
        "/v1/models/./tiny",
        "/v1/models/../models",
        "/openapi.json",
        "/-/routes",
        "/docs",
        "/tokenize",
        "/detokenize",
        "/v1/score",
        "/v1/audio/transcriptions",
        "/metrics",
        "/readyz",
        "/",
        "/v1",
        "/v1/",
        "//v1/models",
        "/v1/models/",
        "/v1/models/no-such-model",
        "/V1/models",
        "/v1/Models",
        "/v1/models%2F",
        "/v1/models%3Fx=1",
    ],
)
def test_unserved_and_dot_segment_paths_are_404_and_never_reach_the_upstream(gateway, recorded, key, raw, target):
    status, _, answer = raw(gateway, "GET", target, headers=auth(key))
    assert status == 404 and json.loads(answer)["error"]["type"] == "invalid_request_error"
    assert recorded.seen == []


def test_unknown_paths_are_404_before_any_key_check(gateway, recorded, raw):
    status, _, answer = raw(gateway, "GET", "/v1/%252e%252e/tokenize")
    assert status == 404 and json.loads(answer)["error"]["code"] == "unknown_url"


@pytest.mark.parametrize(
    ("method", "target", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("HEAD", "/v1/models", "GET"),
        ("OPTIONS", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/completions", "POST"),
        ("DELETE", "/v1/models", "GET"),
        ("TRACE", "/v1/models", "GET"),
        ("post", "/v1/chat/completions", None),  # methods are case-sensitive (RFC 9110 9.1): uvicorn refuses it
        ("FOO", "/v1/chat/completions", None),
    ],
)
def test_other_methods_are_refused_and_never_reach_the_upstream(gateway, recorded, key, raw, method, target, allow):
    status, headers, _ = raw(gateway, method, target, headers=auth(key), body=json.dumps(CHAT).encode())
    if allow is None:
        assert status in (400, 405)
    else:
        assert status == 405 and headers["allow"] == allow
    assert recorded.seen == []


@pytest.mark.parametrize("target", ["/v1/%63hat/completions", "/v1/chat%2Fcompletions", "/v1%2Fchat%2Fcompletions"])
def test_a_once_encoded_path_is_the_route_it_decodes_to_with_all_its_rules(gateway, recorded, key, raw, target):
    over = json.dumps({**CHAT, "max_tokens": 1_000_000}).encode()
    status, _, answer = raw(gateway, "POST", target, headers=auth(key), body=over)
    assert status == 400 and json.loads(answer)["error"]["param"] == "max_tokens"  # the completions policy applied
    assert recorded.seen == []
    status, _, _ = raw(gateway, "POST", target, headers=auth(key), body=json.dumps(CHAT).encode())
    assert status == 200
    assert [seen.request_line for seen in recorded.seen] == ["POST /v1/chat/completions"]  # canonical bytes


def test_query_strings_are_dropped(gateway, recorded, key, raw):
    status, _, _ = raw(gateway, "GET", "/v1/models?api-version=1&x=%2e%2e", headers=auth(key))
    assert status == 200
    status, _, _ = raw(
        gateway,
        "POST",
        "/v1/chat/completions?stream=true&max_tokens=9999",
        headers=auth(key),
        body=json.dumps(CHAT).encode(),
    )
    assert status == 200
    assert [seen.request_line for seen in recorded.seen] == ["GET /v1/models", "POST /v1/chat/completions"]


def test_a_get_route_sends_no_body_upstream(gateway, recorded, key, raw):
    status, _, answer = raw(gateway, "GET", "/v1/models", headers=auth(key), body=b'{"model": "tiny"}')
    assert status == 400 and json.loads(answer)["error"]["code"] == "unexpected_body"
    assert raw(gateway, "GET", "/v1/models", headers=auth(key))[0] == 200
    assert [(seen.request_line, seen.body) for seen in recorded.seen] == [("GET /v1/models", b"")]


def test_one_model_is_served_by_its_own_path(gateway, recorded, key, raw):
    assert raw(gateway, "GET", "/v1/models/tiny", headers=auth(key))[0] == 200
    assert [seen.request_line for seen in recorded.seen] == ["GET /v1/models/tiny"]


def test_a_restricted_key_sees_and_reads_only_its_models(gateway, recorded, make_key, raw):
    restricted = make_key(allowed_models=["tiny"])
    status, _, answer = raw(gateway, "GET", "/v1/models", headers=auth(restricted))
    assert status == 200 and [m["id"] for m in json.loads(answer)["data"]] == ["tiny"]  # the upstream lists two
    status, _, answer = raw(gateway, "GET", "/v1/models/other", headers=auth(restricted))
    assert status == 404 and json.loads(answer)["error"]["code"] == "model_not_found"
    assert [seen.request_line for seen in recorded.seen] == ["GET /v1/models"]
    unrestricted = make_key()
    status, _, answer = raw(gateway, "GET", "/v1/models", headers=auth(unrestricted))
    assert [m["id"] for m in json.loads(answer)["data"]] == ["tiny", "other"]


# --- per-model Serve applications (direct serving path) ------------------------------------------

ROUTES = {"tiny": "/tiny", "other": "/other-model"}


def test_the_upstream_prefix_comes_from_the_settings_only():
    assert upstream_prefix_for("tiny", ROUTES) == "/tiny"
    assert upstream_prefix_for(None, ROUTES) == ""  # GET /v1/models: the list application at /
    assert upstream_prefix_for("unknown", ROUTES) == ""
    assert upstream_prefix_for("tiny", {}) == ""  # one application at / (paths through an OpenAI ingress)
    assert upstream_prefix_for("m", {"m": "/"}) == ""


@pytest.mark.parametrize("prefix", ["tiny", "/../admin", "/a/./b", "/a?x=1", "/a\\b", "/%2e%2e", "/a b", "//a"])
def test_settings_refuse_route_prefixes_that_are_not_canonical_paths(prefix):
    with pytest.raises(ValueError, match="route prefix"):
        GatewaySettings(upstream_url="http://serve:8000", model_routes={"m": prefix})


def test_each_model_goes_to_its_own_application_and_nothing_in_the_request_picks_another(
    start_gateway, recorded, key, raw
):
    with start_gateway(model_routes=ROUTES) as (api, _):
        for model in ("tiny", "other"):
            status, _, _ = raw(
                api,
                "POST",
                "/v1/chat/completions",
                headers=auth(key),
                body=json.dumps({**CHAT, "model": model}).encode(),
            )
            assert status == 200
        assert raw(api, "GET", "/v1/models", headers=auth(key))[0] == 200
        # A model the stack does not serve is refused by the gateway (404, never sent), and no
        # spelling of the model or of the path picks an application.
        for model in ("../../admin", "/tiny", "tiny/../other"):
            status, _, _ = raw(
                api,
                "POST",
                "/v1/chat/completions",
                headers=auth(key),
                body=json.dumps({**CHAT, "model": model}).encode(),
            )
            assert status == 404
        assert (
            raw(api, "POST", "/tiny/v1/chat/completions", headers=auth(key), body=json.dumps(CHAT).encode())[0] == 404
        )
    assert [s.request_line for s in recorded.seen] == [
        "POST /tiny/v1/chat/completions",
        "POST /other-model/v1/chat/completions",
        "GET /v1/models",
    ]
