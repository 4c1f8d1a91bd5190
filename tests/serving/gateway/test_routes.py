"""Per-model routing to Ray Serve applications (direct serving path): through real HTTP, the
gateway forwards each model's requests under that model's route prefix, and nothing a
client sends can choose the prefix."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from ops.devstack.local_redis import redis_server_path
from ops.harness.processes import free_port
from serving.gateway.app import create_app
from serving.gateway.keys import RedisKeyStore, create_key_sync
from serving.gateway.routes import upstream_prefix_for
from serving.gateway.settings import GatewaySettings

ROUTES = {"tiny": "/tiny", "other": "/other-model"}
HANG_BOUND_S = 20  # only bounds a hang


def test_prefix_comes_from_the_settings_only():
    assert upstream_prefix_for("tiny", ROUTES) == "/tiny"
    assert upstream_prefix_for(None, ROUTES) == ""  # GET /v1/models: the list at /
    assert upstream_prefix_for("unknown", ROUTES) == ""  # answered by the list app with a 404
    assert upstream_prefix_for("tiny", {}) == ""  # one application at / (paths through an OpenAI ingress)
    assert upstream_prefix_for("m", {"m": "/"}) == ""


@pytest.mark.parametrize("prefix", ["tiny", "/../admin", "/a/./b", "/a?x=1", "/a\\b"])
def test_settings_refuse_prefixes_that_are_not_plain_paths(prefix):
    with pytest.raises(ValueError, match="route prefix"):
        GatewaySettings(upstream_url="http://serve:8000", model_routes={"m": prefix})


class PathRecorder:
    """An OpenAI-shaped upstream that answers every path and records which one it was sent."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def any(self, request: Request) -> JSONResponse:
        self.paths.append(request.url.path)
        if request.method == "GET":
            return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "x"}]})
        body = await request.json()
        usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        return JSONResponse({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                             "usage": usage, "choices": [{"index": 0, "finish_reason": "stop",
                                                          "message": {"role": "assistant", "content": "ok"}}]})

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.any, methods=["GET", "POST"])])


@contextmanager
def serving(app) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + HANG_BOUND_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on port {port}")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(HANG_BOUND_S)


@pytest.mark.skipif(redis_server_path() is None, reason="needs redis-server (apt-get install redis-server)")
def test_each_model_goes_to_its_application(redis_server):
    upstream = PathRecorder()
    with serving(upstream.app()) as upstream_url:
        settings = GatewaySettings(upstream_url=upstream_url, redis_url=redis_server.url, models=["tiny", "other"],
                                   model_routes=ROUTES)
        with serving(create_app(settings, RedisKeyStore(redis_server.url))) as gateway:
            key = create_key_sync(redis_server.url, "acme", "routes")
            llm = openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
            for model in ("tiny", "other"):
                llm.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            llm.models.list()
            # A model the stack does not route goes to `/` (where Serve's model list answers 404),
            # never to a path of the client's making.
            llm.chat.completions.create(model="../../admin", messages=[{"role": "user", "content": "x"}])
    assert upstream.paths == ["/tiny/v1/chat/completions", "/other-model/v1/chat/completions", "/v1/models",
                              "/v1/chat/completions"]
