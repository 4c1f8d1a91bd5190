"""The one dev stack the end-to-end tests share (make test runs them in a pytest process of their own,
beside the one that runs every other test): `python -m ops.devstack` (what `make dev` runs)
with a real redis-server, Ray Serve, CPU vLLM and the gateway, started once for the session
(about a minute on 2 cores, most of the e2e phase's cost) and stopped at its end, where SIGTERM
must stop everything it started.

It runs a copy of Pulumi.local.yaml (see `e2e_stack_file`). Every test leaves the stack as it
found it: keys and tenants of its own, replica bounds restored (`restore_autoscaling`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from infra.spec.stack_file import PROJECT_ROOT, load_stack
from tests.support.devstack import DevStack, e2e_stack_text

E2E = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that start a stack or engine of their own first, before the shared one starts."""
    items.sort(key=lambda item: E2E in item.path.parents and "dev_stack" in item.fixturenames)


@pytest.fixture(autouse=True)
def no_ray_cluster_from_a_unit_test() -> None:
    """End-to-end tests start Ray on purpose (tests/conftest.py stops unit tests doing it)."""


@pytest.fixture(scope="session")
def e2e_stack_file() -> Iterator[Path]:
    """Pulumi.local.yaml with the changes of `e2e_stack_text`, named like it so that `llmctl scale
    --stack <it>` applies to the running stack."""
    folder = Path(tempfile.mkdtemp(prefix="llmstack-e2e-"))
    path = folder / "Pulumi.local.yaml"
    path.write_text(e2e_stack_text((PROJECT_ROOT / "Pulumi.local.yaml").read_text()))
    yield path
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def dev_stack(e2e_stack_file: Path) -> Iterator[DevStack]:
    """The running shared stack. Its teardown is a test of `make dev`'s stop: SIGTERM exits 0,
    nothing it started is left running, and its start had said when the first token came. It
    traces every request, as `make dev TRACE=1` (tests/e2e/test_tracing.py reads the spans)."""
    stack = DevStack(str(e2e_stack_file), trace=True)
    try:
        yield stack
    finally:
        assert stack.descendants, "ops.devstack started child processes"
        assert stack.stop() == 0
        assert not stack.alive_descendants(), "left running after SIGTERM"
        assert any("first token through the gateway" in line for line in stack.stderr)


@pytest.fixture(scope="session")
def dev_client(dev_stack: DevStack) -> openai.OpenAI:
    """The official client with the stack's dev key."""
    return openai.OpenAI(
        base_url=dev_stack.ready["base_url"], api_key=dev_stack.ready["api_key"], max_retries=0, timeout=120
    )


def bounds(stack_file: Path, model: str) -> tuple[int, int, float]:
    """(min_replicas, max_replicas, target_ongoing_requests) the stack file gives the model,
    defaults included."""
    scaling = load_stack(stack_file).model(model).autoscaling
    return scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests


@pytest.fixture
def restore_autoscaling(dev_stack: DevStack, e2e_stack_file: Path) -> Iterator[Callable[[str], None]]:
    """`restore_autoscaling(model)`: the model's replica bounds and target load are put back live
    after the test (`llmctl scale`), so the next test finds the stack as it was."""
    models: dict[str, tuple[int, int, float]] = {}

    def remember(model: str) -> None:
        models.setdefault(model, bounds(e2e_stack_file, model))

    yield remember
    for model, (minimum, maximum, target) in models.items():
        if bounds(e2e_stack_file, model) == (minimum, maximum, target):
            continue
        result = dev_stack.llmctl(
            "scale",
            "--stack",
            str(e2e_stack_file),
            "--model",
            model,
            "--min",
            str(minimum),
            "--max",
            str(maximum),
            "--target-ongoing",
            str(target),
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert bounds(e2e_stack_file, model) == (minimum, maximum, target)
