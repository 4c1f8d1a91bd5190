"""Fixtures for the gateway's tests, on the harness in tests/support/gateway.py: a recording
upstream per module, a gateway in front of it, and keys in the root conftest's redis-server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest

from serving.gateway.keys import create_key_sync
from tests.support.gateway import (
    GENEROUS,
    RecordingUpstream,
    default_answer,
    gateway_settings,
    raw_request,
    serving,
    serving_gateway,
)


@pytest.fixture(scope="module")
def upstream() -> Iterator[RecordingUpstream]:
    recorder = RecordingUpstream()
    with serving(recorder) as url:
        recorder.url = url
        yield recorder


@pytest.fixture
def recorded(upstream: RecordingUpstream) -> RecordingUpstream:
    """The module's upstream with an empty record and its default answers."""
    upstream.seen.clear()
    upstream.answer = default_answer
    return upstream


@pytest.fixture(scope="module")
def gateway(redis_server, upstream) -> Iterator[str]:
    """A gateway with default settings in front of the recording upstream: its API URL."""
    with serving_gateway(gateway_settings(upstream.url, redis_server.url)) as (api, _):
        yield api


@pytest.fixture(scope="module")
def start_gateway(redis_server, upstream) -> Callable[..., AbstractContextManager[tuple[str, str]]]:
    """`with start_gateway(**settings) as (api, metrics):` a gateway with its own settings."""
    return lambda **overrides: serving_gateway(gateway_settings(upstream.url, redis_server.url, **overrides))


@pytest.fixture(scope="module")
def key(redis_server) -> str:
    return create_key_sync(redis_server.url, "acme", "attacker", limits=GENEROUS)


@pytest.fixture(scope="module")
def make_key(redis_server) -> Callable[..., str]:
    return lambda **fields: create_key_sync(redis_server.url, "acme", "test", limits=GENEROUS, **fields)


@pytest.fixture(scope="module")
def raw() -> Callable[..., tuple[int, dict[str, str], bytes]]:
    return raw_request
