"""The live replica feed: Ray's REST API body -> running replicas per model (checked against Ray's own
response schema), and a gateway whose model capacity follows what a dashboard reports, falling back
to the stack's figure when the dashboard fails."""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.gateway.auth.keys import create_key_sync
from serving.gateway.config.queue_policy import ModelQueue, QueuePolicy, QueueTier
from serving.gateway.queue.fair_queue import queue_keys
from serving.gateway.queue.replica_feed import running_replicas
from tests.support.gateway import GENEROUS, gateway_settings, serving_gateway
from tests.support.servers import HANG_BOUND_S, serving
from tests.support.waiting import eventually


def replica(state: str, n: int) -> dict:
    return {
        "replica_id": f"r{n}",
        "state": state,
        "start_time_s": 1.0,
        "node_id": "n1",
        "node_ip": "10.0.0.1",
        "actor_id": f"a{n}",
        "actor_name": f"SERVE_REPLICA::{n}",
        "worker_id": "w",
        "log_file_path": "/tmp/x",
    }


def deployment(name: str, states: list[str]) -> dict:
    return {
        "name": name,
        "status": "HEALTHY",
        "status_trigger": "AUTOSCALING",
        "message": "",
        "deployment_config": {"name": name},
        "target_num_replicas": len(states),
        "required_resources": {},
        "replicas": [replica(state, n) for n, state in enumerate(states)],
    }


def application(name: str, prefix: str, deployments: dict[str, list[str]]) -> dict:
    return {
        "name": name,
        "route_prefix": prefix,
        "docs_path": None,
        "status": "RUNNING",
        "message": "",
        "last_deployed_time_s": 1.0,
        "source": "declarative",
        "external_scaler_enabled": False,
        "deployments": {d: deployment(d, states) for d, states in deployments.items()},
    }


def details(applications: list[dict]) -> dict:
    """A `GET /api/serve/applications/` body (ray.serve.schema.ServeInstanceDetails)."""
    return {
        "controller_info": {},
        "proxies": {},
        "target_capacity": None,
        "applications": {a["name"]: a for a in applications},
    }


# The direct serving path: one application per model, plus the model list's own application.
DIRECT = details(
    [
        application("tiny-chat", "/tiny-chat", {"LLMServer:tiny-chat": ["RUNNING", "STARTING", "RUNNING", "STOPPING"]}),
        application("tiny-code", "/tiny-code", {"LLMServer:tiny-code": []}),
        application("models", "/", {"ModelList": ["RUNNING"]}),
    ]
)
DEPLOYMENTS = {"tiny-chat": "LLMServer:tiny-chat", "tiny-code": "LLMServer:tiny-code", "absent": "LLMServer:absent"}


def test_the_fixture_is_what_ray_serves():
    from ray.serve.schema import ServeInstanceDetails

    ServeInstanceDetails.model_validate(DIRECT)  # extra="forbid" models: a wrong field name fails here


def test_running_replicas_counts_running_ones_per_model_and_leaves_unknown_models_out():
    assert running_replicas(DIRECT, DEPLOYMENTS) == {"tiny-chat": 2, "tiny-code": 0}


def test_one_application_for_every_model_counts_the_same():
    shared = details(
        [
            application(
                "llm",
                "/",
                {"LLMServer:tiny-chat": ["RUNNING"], "OpenAiIngress": ["RUNNING"], "LLMServer:tiny-code": ["STARTING"]},
            )
        ]
    )
    assert running_replicas(shared, DEPLOYMENTS) == {"tiny-chat": 1, "tiny-code": 0}


@pytest.mark.parametrize("body", [[], {"applications": []}, "not json", None])
def test_a_body_that_is_not_serve_details_is_refused(body):
    with pytest.raises(ValueError):
        running_replicas(body, DEPLOYMENTS)


# --- a gateway following a dashboard ------------------------------------------------------------------


class Dashboard:
    """Answers the REST API with `running` replicas of the model's deployment, 503 when `failing`,
    401 without Ray's token (token authentication on, as Ray 2.60's local ray.init has it)."""

    TOKEN = "ray-token-for-tests"

    def __init__(self, model: str) -> None:
        self.model, self.running, self.failing, self.polls = model, 1, False, 0

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/api/serve/applications/", self.applications, methods=["GET"])])

    async def applications(self, request: Request) -> Response:
        self.polls += 1
        if request.headers.get("authorization") != f"Bearer {self.TOKEN}":
            return Response("Unauthorized: Missing authentication token", status_code=401)
        if self.failing:
            return Response("Failed to get a response from the controller.", status_code=503)
        body = details(
            [application(self.model, f"/{self.model}", {f"LLMServer:{self.model}": ["RUNNING"] * self.running})]
        )
        return JSONResponse(copy.deepcopy(body))


class HoldingUpstream:
    def __init__(self) -> None:
        self.gate, self.running = threading.Event(), 0

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.running += 1
        try:
            while not self.gate.is_set():
                await asyncio.sleep(0.01)
        finally:
            self.running -= 1
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}],
            }
        )


def test_the_gateway_follows_live_replicas_and_falls_back_when_the_dashboard_fails(redis_server, caplog):
    model = f"m-{uuid.uuid4().hex[:8]}"
    key = create_key_sync(redis_server.url, "acme", "feed", limits=GENEROUS)
    keys = queue_keys(model, 1)
    store = redis.Redis.from_url(redis_server.url)
    dashboard, upstream = Dashboard(model), HoldingUpstream()
    policy = QueuePolicy(tiers=[QueueTier(name="standard", queue_timeout_s=HANG_BOUND_S)])
    # The stack says up to 4 replicas of one request each: without the feed, capacity 4.
    queue = ModelQueue(max_ongoing_requests=1, min_replicas=0, max_replicas=4, cold_start_timeout_s=HANG_BOUND_S)

    def chat(api: str) -> int:
        return httpx.post(
            f"{api}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": model, "messages": [{"role": "user", "content": "hi"}]},
            timeout=HANG_BOUND_S,
        ).status_code

    caplog.set_level(logging.INFO, logger="llmstack.gateway.replica_feed")
    with serving(dashboard.app()) as dashboard_url, serving(upstream.app()) as upstream_url:
        settings = gateway_settings(
            upstream_url,
            redis_server.url,
            models=[model],
            model_context_lengths={model: 4096},
            queue=policy,
            model_queues={model: queue},
            serve_dashboard_url=dashboard_url,
            model_deployments={model: f"LLMServer:{model}"},
            replica_poll_s=0.2,
            ray_auth_token=Dashboard.TOKEN,
        )
        with serving_gateway(settings) as (api, metrics), ThreadPoolExecutor(4) as pool:
            eventually(lambda: store.get(keys.replicas) == b"1", "the dashboard's one replica reaches Redis")
            first = pool.submit(chat, api)
            eventually(lambda: upstream.running == 1, "one request runs")
            second = pool.submit(chat, api)
            eventually(lambda: store.zcard(keys.queues[0]) == 1, "the second waits: one live replica, capacity 1")
            assert upstream.running == 1

            dashboard.running = 2  # Serve scaled up: the waiting request goes at the next poll
            eventually(lambda: upstream.running == 2, "the second runs once two replicas are reported")
            exposition = httpx.get(f"{metrics}/metrics", timeout=HANG_BOUND_S).text
            assert f'llmstack_gateway_model_replicas{{model="{model}"}} 2.0' in exposition

            dashboard.failing = True
            polls = dashboard.polls
            eventually(lambda: dashboard.polls >= polls + 3, "the gateway keeps polling")
            eventually(lambda: store.get(keys.replicas) is None, "the last count expires: the stack's figure holds")
            exposition = httpx.get(f"{metrics}/metrics", timeout=HANG_BOUND_S).text
            errors = [
                line
                for line in exposition.splitlines()
                if line.startswith('llmstack_gateway_replica_feed_errors_total{kind="status"} ')
            ]
            assert errors and float(errors[0].split()[1]) >= 3
            third = pool.submit(chat, api)  # capacity is max_replicas x 1 = 4 again: runs at once
            eventually(lambda: upstream.running == 3, "a third runs under the stack's capacity")
            upstream.gate.set()
            assert [f.result() for f in (first, second, third)] == [200, 200, 200]
    store.close()
    warnings = [r for r in caplog.records if r.name == "llmstack.gateway.replica_feed" and r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one line per outage, however many polls failed
