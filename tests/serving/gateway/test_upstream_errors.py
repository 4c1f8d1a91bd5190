"""What the upstream answers is never relayed when it could name internals: redirects and error
bodies become OpenAI errors of the gateway's own, and only body-describing response headers
pass. The upstream here answers the way Ray Serve LLM does (bodies built like ray 2.60's
`get_response_for_error`), through a real gateway.
"""

from __future__ import annotations

import json

import openai
import pytest

from serving.gateway.upstream_errors import rewritten
from tests.support.gateway import Answer
from tests.support.servers import HANG_BOUND_S

SERVE_ADDRESS = "llmstack-serve-svc.llmstack.svc.cluster.local:8000"
INTERNAL = (SERVE_ADDRESS, "10.0.3.7", "RayActorError", "Internal exception", "original exception",
            "/home/ray/anaconda3", "Traceback", "LLMServer", "uvicorn")


def ray_error(status: int, message: str, internal: str) -> bytes:
    """An error body as Ray Serve LLM builds it: its message, its internal message, str(exc), the
    exception class as `type`."""
    return json.dumps({"object": "error", "error": {
        "message": f"Message: {message}, Internal exception: {internal}, original exception: {internal}",
        "code": status, "type": "RayActorError" if status >= 500 else "OpenAIHTTPException", "param": None,
    }}).encode()


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
    internal = ("ray.exceptions.RayActorError: The actor died unexpectedly. LLMServer on node 10.0.3.7 "
                "Traceback: File /home/ray/anaconda3/lib/python3.12/site-packages/vllm/engine.py")
    scripted(recorded, status, ray_error(status, "Internal Server Error", internal), ("server", "uvicorn"),
             ("x-ray-node", "10.0.3.7"))
    error = call(gateway, key)
    assert error.status_code >= 500 and error.response.json()["error"]["type"] == "server_error"
    assert_names_nothing_internal(error)


def test_validation_errors_keep_their_status_not_their_text(gateway, recorded, key):
    scripted(recorded, 400, ray_error(400, "Invalid request format: Input should be a valid dictionary at "
                                           "('body', 'messages', 0)", "ValueError in /home/ray/anaconda3/x.py"))
    error = call(gateway, key)
    assert error.status_code == 400 and error.code == "invalid_request"
    assert_names_nothing_internal(error)


def test_the_context_length_refusal_keeps_its_numbers_only(gateway, recorded, key):
    vllm_message = ("This model's maximum context length is 512 tokens. However, your prompt contains 900 input "
                    "tokens, which exceeds this limit even without any output tokens.")
    scripted(recorded, 400, ray_error(400, vllm_message, "VLLMValidationError at /home/ray/anaconda3/v.py"))
    error = call(gateway, key)
    assert error.status_code == 400 and error.code == "context_length_exceeded"
    assert "512 tokens" in error.message
    assert_names_nothing_internal(error)


def test_an_unknown_model_is_404_model_not_found(gateway, recorded, key):
    scripted(recorded, 404, ray_error(404, "Unable to find tiny. Please ensure that the model exists",
                                      "OpenAIHTTPException on 10.0.3.7"))
    error = call(gateway, key)
    assert error.status_code == 404 and error.code == "model_not_found"
    assert_names_nothing_internal(error)


def test_only_body_headers_come_back(gateway, recorded, key):
    body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "tiny", "choices": [],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
    scripted(recorded, 200, body, ("server", "uvicorn"), ("x-ray-node", "10.0.3.7"), ("set-cookie", "s=1"),
             ("x-request-id", "ray-internal-id"), ("cache-control", "no-cache"))
    llm = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
    response = llm.chat.completions.with_raw_response.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    headers = response.headers
    assert "x-ray-node" not in headers and "set-cookie" not in headers and "server" not in headers
    assert headers["x-request-id"] != "ray-internal-id" and headers["cache-control"] == "no-cache"


@pytest.mark.parametrize(("status", "expected"), [
    (301, 502), (307, 502), (308, 502), (400, 400), (401, 502), (403, 502), (404, 404), (405, 405), (408, 504),
    (413, 413), (422, 400), (429, 503), (500, 500), (501, 501), (502, 502), (503, 503), (504, 504),
])
def test_every_status_maps_to_an_openai_error_of_ours(status, expected):
    response = rewritten(status, ray_error(status, "boom", "at 10.0.3.7"))
    assert response.status_code == expected
    error = json.loads(response.body)["error"]
    assert error["type"] == ("server_error" if expected >= 500 else "invalid_request_error")
    assert "10.0.3.7" not in response.body.decode() and "boom" not in response.body.decode()
