"""Fixtures for the Batch API's tests: a real gateway (uvicorn, in a thread) in front of the
recording upstream, with batch files in a temporary directory and keys in the module's redis-server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from serving.gateway.keys import create_key_sync
from tests.support.gateway import GENEROUS, RecordingUpstream, default_answer, gateway_settings, serving_gateway
from tests.support.servers import HANG_BOUND_S, serving

FAST = {"sweep_interval_s": 0.1, "workers": 4, "lease_s": 2}


@pytest.fixture(scope="module")
def upstream() -> Iterator[RecordingUpstream]:
    recorder = RecordingUpstream()
    with serving(recorder) as url:
        recorder.url = url
        yield recorder


@pytest.fixture
def recorded(upstream: RecordingUpstream) -> RecordingUpstream:
    upstream.seen.clear()
    upstream.answer = default_answer
    return upstream


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def start_gateway(redis_server, upstream, batch_dir):
    """`with start_gateway(batch={...}, **settings) as (api, metrics):` a gateway with the Batch API."""
    def start(batch: dict | None = None, **overrides):
        return serving_gateway(gateway_settings(upstream.url, redis_server.url,
                                                batch_storage_url=f"file://{batch_dir}",
                                                batch={**FAST, **(batch or {})}, **overrides))
    return start


@pytest.fixture(scope="module")
def gateway(start_gateway) -> Iterator[str]:
    with start_gateway() as (api, _):
        yield api


@pytest.fixture(scope="module")
def make_key(redis_server) -> Callable[..., str]:
    return lambda tenant="acme", **fields: create_key_sync(redis_server.url, tenant, "batch-test",
                                                           limits=GENEROUS, **fields)


@pytest.fixture(scope="module")
def client_for(gateway) -> Callable[[str], openai.OpenAI]:
    return lambda key: openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
