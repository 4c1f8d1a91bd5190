"""Fixtures for every test: the example stacks, the tiny local models, a private redis-server."""

from __future__ import annotations

import pytest

from infra.spec import StackSpec
from infra.stack_file import PROJECT_ROOT, load_stack
from tests.support.stacks import EXAMPLE_STACKS, TEST_CLOUD_STACKS


@pytest.fixture(scope="session", autouse=True)
def local_models() -> None:
    """The tiny models the local example stacks load, built once (the planner reads their
    config.json; infra never builds them itself)."""
    from ops.devstack.local_models import ensure_local_models

    for stack in ("local", PROJECT_ROOT / "tests" / "stacks" / "Pulumi.draft.yaml"):
        ensure_local_models(load_stack(stack))


@pytest.fixture(scope="module")
def redis_server():
    """A private, real redis-server for one test module (stopped afterwards, pass or fail)."""
    from ops.devstack.local_redis import running_redis

    with running_redis() as server:
        yield server


@pytest.fixture(scope="session", params=[*EXAMPLE_STACKS, *TEST_CLOUD_STACKS],
                ids=lambda p: p if isinstance(p, str) else p.name)
def example_stack(request: pytest.FixtureRequest) -> StackSpec:
    return load_stack(request.param)
