"""What the upstream answers is never relayed when it could name internals: redirects and error
bodies become OpenAI errors of the gateway's own, and only body-describing response headers
pass. The upstream here answers the way Ray Serve LLM does (bodies built like ray 2.60's
`get_response_for_error`), through a real gateway.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.protocol import errors
from serving.gateway.protocol.upstream_errors import rewritten
from tests.support.gateway import Answer
from tests.support.servers import HANG_BOUND_S
from tests.support.vllm_upstream import directive, key_id_of, running_gateway
from tests.support.waiting import eventually

SERVE_ADDRESS = "llmstack-serve-svc.llmstack.svc.cluster.local:8000"
INTERNAL = (
    SERVE_ADDRESS,
    "10.0.3.7",
    "RayActorError",
    "Internal exception",
    "original exception",
    "/home/ray/anaconda3",
    "Traceback",
    "LLMServer",
    "uvicorn",
)


def ray_error(status: int, message: str, internal: str) -> bytes:
    """An error body as Ray Serve LLM builds it: its message, its internal message, str(exc), the
    exception class as `type`."""
    return json.dumps(
        {
            "object": "error",
            "error": {
                "message": f"Message: {message}, Internal exception: {internal}, original exception: {internal}",
                "code": status,
                "type": "RayActorError" if status >= 500 else "OpenAIHTTPException",
                "param": None,
            },
        }
    ).encode()


def scripted(upstream, status: int, body: bytes, *headers: tuple[str, str]) -> None:
    upstream.answer = lambda seen: Answer(status, (("content-type", "application/json"), *headers), body)


def call(gateway: str, key: str) -> openai.APIStatusError:
    llm = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    with pytest.raises(openai.APIStatusError) as caught:
        llm.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    return caught.value


def assert_names_nothing_internal(error: openai.APIStatusError) -> None:
    text = json.dumps(dict(error.response.headers)) + error.response.text
    for word in INTERNAL:
        assert word not in text, word
    assert set(error.response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_redirect_is_not_relayed(gateway, recorded, key):
    scripted(recorded, 307, b"", ("location", f"http://{SERVE_ADDRESS}/v1/chat/completions/"))
    error = call(gateway, key)
    assert error.status_code == 502 and "location" not in error.response.headers
    assert_names_nothing_internal(error)
    assert len(recorded.seen) == 1  # not followed either


@pytest.mark.parametrize("status", [500, 502, 503, 504])
def test_server_errors_name_nothing_internal(gateway, recorded, key, status):
    internal = (
        "ray.exceptions.RayActorError: The actor died unexpectedly. LLMServer on node 10.0.3.7 "
        "Traceback: File /home/ray/anaconda3/lib/python3.12/site-packages/vllm/engine.py"
    )
    scripted(
        recorded,
        status,
        ray_error(status, "Internal Server Error", internal),
        ("server", "uvicorn"),
        ("x-ray-node", "10.0.3.7"),
    )
    error = call(gateway, key)
    assert error.status_code >= 500 and error.response.json()["error"]["type"] == "server_error"
    assert_names_nothing_internal(error)


def test_validation_errors_keep_their_status_not_their_text(gateway, recorded, key):
    scripted(
        recorded,
        400,
        ray_error(
            400,
            "Invalid request format: Input should be a valid dictionary at ('body', 'messages', 0)",
            "ValueError in /home/ray/anaconda3/x.py",
        ),
    )
    error = call(gateway, key)
    assert error.status_code == 400 and error.code == "invalid_request"
    assert_names_nothing_internal(error)


def test_the_context_length_refusal_keeps_its_numbers_only(gateway, recorded, key):
    vllm_message = (
        "This model's maximum context length is 512 tokens. However, your prompt contains 900 input "
        "tokens, which exceeds this limit even without any output tokens."
    )
    scripted(recorded, 400, ray_error(400, vllm_message, "VLLMValidationError at /home/ray/anaconda3/v.py"))
    error = call(gateway, key)
    assert error.status_code == 400 and error.code == "context_length_exceeded"
    assert "512 tokens" in error.message
    assert_names_nothing_internal(error)


def test_an_unknown_model_is_404_model_not_found(gateway, recorded, key):
    scripted(
        recorded,
        404,
        ray_error(404, "Unable to find tiny. Please ensure that the model exists", "OpenAIHTTPException on 10.0.3.7"),
    )
    error = call(gateway, key)
    assert error.status_code == 404 and error.code == "model_not_found"
    assert_names_nothing_internal(error)


def test_only_body_headers_come_back(gateway, recorded, key):
    body = json.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "created": 0,
            "model": "tiny",
            "choices": [],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()
    scripted(
        recorded,
        200,
        body,
        ("server", "uvicorn"),
        ("x-ray-node", "10.0.3.7"),
        ("set-cookie", "s=1"),
        ("x-request-id", "ray-internal-id"),
        ("cache-control", "no-cache"),
    )
    llm = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    response = llm.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    headers = response.headers
    assert "x-ray-node" not in headers and "set-cookie" not in headers and "server" not in headers
    assert headers["x-request-id"] != "ray-internal-id" and headers["cache-control"] == "no-cache"


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (301, 502),
        (307, 502),
        (308, 502),
        (400, 400),
        (401, 502),
        (403, 502),
        (404, 404),
        (405, 405),
        (408, 504),
        (413, 413),
        (422, 400),
        (429, 503),
        (500, 500),
        (501, 501),
        (502, 502),
        (503, 503),
        (504, 504),
    ],
)
def test_every_status_maps_to_an_openai_error_of_ours(status, expected):
    response = errors.response_for(rewritten(status, ray_error(status, "boom", "at 10.0.3.7")))
    assert response.status_code == expected
    error = json.loads(response.body)["error"]
    assert error["type"] == ("server_error" if expected >= 500 else "invalid_request_error")
    assert "10.0.3.7" not in response.body.decode() and "boom" not in response.body.decode()


# --- an error inside a 200 stream ----------------------------------------------------------------


@pytest.fixture(scope="module")
def streaming_gateway(redis_server, upstream):
    """The gateway in front of the vLLM-like upstream, whose engine can fail mid-stream."""
    with running_gateway(upstream.url, redis_server.url, model_context_lengths={"tiny": 4096}) as url:
        yield url


def test_an_error_event_inside_a_stream_names_nothing_internal_and_is_billed(
    streaming_gateway, upstream, redis_server, access_lines
):
    """vLLM streams an engine failure as a `data: {"error": ...}` event after the 200 status line;
    Ray wraps it with its internal exception text and addresses. It reached clients verbatim."""
    key = create_key_sync(redis_server.url, "acme", "stream-error")
    messages = [{"role": "user", "content": directive(id="fails", tokens=50, interval=0.001, error_after=3)}]
    llm = openai.OpenAI(base_url=f"{streaming_gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    stream = llm.chat.completions.create(model="tiny", messages=messages, max_tokens=50, stream=True)
    texts = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            texts.extend(choice.delta.content for choice in chunk.choices if choice.delta.content)
    assert texts == [" tok"] * 3  # what was generated before the failure came through
    assert caught.value.message == "The model servers failed while handling the request. Please retry."
    for word in INTERNAL:
        assert word not in json.dumps(caught.value.body), word
    # The whole stream as bytes: the error event is ours, with the status it stands for.
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [
                {"role": "user", "content": directive(id="fails-raw", tokens=50, interval=0.001, error_after=2)}
            ],
            "max_tokens": 50,
            "stream": True,
        }
    )
    raw = httpx.post(
        f"{streaming_gateway}/v1/chat/completions",
        content=body,
        timeout=HANG_BOUND_S,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    assert raw.status_code == 200 and raw.text.endswith("data: [DONE]\n\n")
    errors = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith('data: {"error"')]
    assert errors == [
        {
            "error": {
                "message": "The model servers failed while handling the request. Please retry.",
                "type": "server_error",
                "param": None,
                "code": "upstream_error",
                "status": 500,
            }
        }
    ]
    for word in INTERNAL:
        assert word not in raw.text, word
    # Billed what the engine generated: its last usage, the stream having ended.
    lines = eventually(
        lambda: access_lines.of(key_id_of(key)) if len(access_lines.of(key_id_of(key))) == 2 else None,
        "the streams never ended",
    )
    for rid, line in zip(("fails", "fails-raw"), lines, strict=True):
        generated = upstream.generated[rid]
        assert line["prompt_tokens"] + line["completion_tokens"] == generated["prompt"] + generated["completion"]
