"""Fixtures for the Batch API's tests, on top of the gateway's (tests/serving/gateway/conftest.py:
`recorded`, `make_key`, and `gateway`, which is this folder's `start_gateway()`): a gateway with
the Batch API on, its files in a temporary directory, sweeping often enough for a test."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from tests.support.servers import HANG_BOUND_S

FAST = {"sweep_interval_s": 0.1, "workers": 4, "lease_s": 2}


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches")


@pytest.fixture(scope="module")
def start_gateway(start_gateway, batch_dir):
    """`with start_gateway(batch={...}, **settings) as (api, metrics):` the parent's gateway with the Batch API."""
    return lambda batch=None, **overrides: start_gateway(
        batch_storage_url=f"file://{batch_dir}", batch={**FAST, **(batch or {})}, **overrides
    )


@pytest.fixture(scope="module")
def client_for(gateway) -> Callable[[str], openai.OpenAI]:
    return lambda key: openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=HANG_BOUND_S)
