"""Fixtures for the gateway's tests: `recording_upstream` (tests/support/gateway.py) records every
request line for the routing and exposure tests; `upstream` (tests/support/vllm_upstream.py) answers
like vLLM for the billing and limit tests; a gateway in front, keys in the root conftest's redis."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from serving.gateway.auth.keys import RedisKeyStore, create_key_sync
from serving.gateway.http.app import create_app
from tests.support.gateway import (
    GENEROUS,
    RecordingUpstream,
    default_answer,
    gateway_settings,
    raw_request,
    serving_gateway,
)
from tests.support.openai_fakes import FakeUpstream, StreamRecordingUpstream, settings_for
from tests.support.servers import serving
from tests.support.servers import serving as serving_app
from tests.support.vllm_upstream import AccessLines, VllmLikeUpstream


@pytest.fixture(scope="module")
def recording_upstream() -> Iterator[RecordingUpstream]:
    """An upstream that records every request line and body it gets (tests.support.gateway)."""
    recorder = RecordingUpstream()
    with serving(recorder) as url:
        recorder.url = url
        yield recorder


@pytest.fixture
def recorded(recording_upstream: RecordingUpstream) -> RecordingUpstream:
    """The module's upstream with an empty record and its default answers."""
    recording_upstream.seen.clear()
    recording_upstream.answer = default_answer
    return recording_upstream


@pytest.fixture(scope="module")
def start_gateway(redis_server, recording_upstream) -> Callable[..., AbstractContextManager[tuple[str, str]]]:
    """`with start_gateway(**settings) as (api, metrics):` a gateway with its own settings."""
    return lambda **overrides: serving_gateway(gateway_settings(recording_upstream.url, redis_server.url, **overrides))


@pytest.fixture(scope="module")
def gateway(start_gateway) -> Iterator[str]:
    """`start_gateway()` for the whole module, in front of the recording upstream: its API URL.
    A folder that overrides `start_gateway` (batch/) gets its gateway from that one."""
    with start_gateway() as (api, _):
        yield api


@pytest.fixture(scope="module")
def key(redis_server) -> str:
    return create_key_sync(redis_server.url, "acme", "attacker", limits=GENEROUS)


@pytest.fixture(scope="module")
def make_key(redis_server) -> Callable[..., str]:
    """`make_key(tenant="acme", **fields)`: a new key with generous limits."""
    return lambda tenant="acme", **fields: create_key_sync(redis_server.url, tenant, "test", limits=GENEROUS, **fields)


@pytest.fixture(scope="module")
def raw() -> Callable[..., tuple[int, dict[str, str], bytes]]:
    return raw_request


@pytest.fixture
def access_lines() -> Iterator[AccessLines]:
    logger = logging.getLogger("llmstack.gateway.access")
    handler = AccessLines()
    # Other tests in a session may import vLLM, whose logging config disables existing loggers.
    was_disabled, old_level = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.disabled, logger.level = was_disabled, old_level


@pytest.fixture(scope="module")
def fake_upstream() -> Iterator[FakeUpstream]:
    """An upstream like Ray Serve's OpenAI ingress: models, chats streamed or not, and the headers
    it got (tests.support.openai_fakes)."""
    fake = FakeUpstream()
    with serving_app(fake.app()) as url:
        fake.url = url
        yield fake


@pytest.fixture(scope="module")
def stream_recording_upstream() -> Iterator[StreamRecordingUpstream]:
    """An OpenAI-like upstream that records every body it gets and sends the usage chunk of a
    stream only when asked, as OpenAI and vLLM do (tests.support.openai_fakes)."""
    fake = StreamRecordingUpstream()
    with serving_app(fake.app()) as url:
        fake.url = url
        yield fake


@pytest.fixture(scope="module")
def fake_upstream_gateway(redis_server, fake_upstream: FakeUpstream) -> Iterator[str]:
    """The URL of a gateway (its ASGI app under uvicorn) in front of `fake_upstream`."""
    settings = settings_for(fake_upstream.url, redis_server.url)
    with serving_app(create_app(settings, RedisKeyStore(redis_server.url))) as url:
        yield url


@pytest.fixture(scope="module")
def api_key(redis_server) -> str:
    """A key of tenant acme with the gateway's default limits."""
    return create_key_sync(redis_server.url, "acme", "tests")


@pytest.fixture(scope="module")
def upstream() -> Iterator[VllmLikeUpstream]:
    """A vLLM-like upstream steered by `#stub` directives in prompts (tests.support.vllm_upstream)."""
    fake = VllmLikeUpstream()
    with serving_app(fake.app()) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake
