"""Fixtures for every test: the example stacks, the tiny local models, a private redis-server.
Also the session's rules: hypothesis profiles, and nothing this run started may outlive it."""

from __future__ import annotations

import os
import sys
import uuid

import pytest
from hypothesis import settings

from infra.spec.schema import StackSpec
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from tests.support.hypothesis import PROFILE
from tests.support.leftovers import RUN_TAG, left_running, stop_leftovers
from tests.support.stacks import EXAMPLE_STACKS, TEST_CLOUD_STACKS

# `make test` runs the "fast" profile; `make test-deep` (HYPOTHESIS_PROFILE=deep) explores more,
# with fresh random examples on every run. "fast" is derandomized: a property's own count of
# what it exercised (see the fuzz tests) is then the same on every run. Per-test example
# counts: tests.support.hypothesis.examples.
settings.register_profile("fast", deadline=None, derandomize=True, database=None)
settings.register_profile("deep", deadline=None)
settings.load_profile(PROFILE)


def pytest_configure(config: pytest.Config) -> None:
    # Every process this run starts inherits the tag (xdist workers, servers, Ray, its HAProxy):
    # what is found with it at the end was left behind by this run, never by someone else's.
    if not hasattr(config, "workerinput"):
        os.environ.setdefault(RUN_TAG, uuid.uuid4().hex)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process it started is still running once every test is done."""
    if hasattr(session.config, "workerinput"):
        return  # each worker's own processes are checked by the controller, after all workers end
    leftovers = left_running(os.environ[RUN_TAG])
    if leftovers:
        stop_leftovers(leftovers)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "FAILED: left running after the tests (stopped now): " + "; ".join(leftovers.values())
        if reporter:
            reporter.ensure_newline()
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def no_ray_cluster_from_a_unit_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any Ray API called before `ray.init` starts a whole local cluster (Ray's auto-init): a
    minute of CPU beside the timing tests, left running after the test. Unit tests get an
    error instead; tests/e2e, which start Ray on purpose, override this fixture."""
    hook = sys.modules.get("ray._private.auto_init_hook")
    if hook is not None:
        monkeypatch.setattr(hook, "enable_auto_connect", False)
    else:  # read when ray is first imported, in this test or later
        monkeypatch.setenv("RAY_ENABLE_AUTO_CONNECT", "0")


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


@pytest.fixture
def empty_redis(redis_server):
    """A client (str replies) of the module's redis-server, emptied for this test: the tests of
    one module share the server, and each starts from nothing."""
    import redis

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(
    scope="session", params=[*EXAMPLE_STACKS, *TEST_CLOUD_STACKS], ids=lambda p: p if isinstance(p, str) else p.name
)
def example_stack(request: pytest.FixtureRequest) -> StackSpec:
    return load_stack(request.param)
