"""Shared fixtures: the example stacks and where the KubeRay CRD schemas live."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.spec import StackSpec
from infra.stack_file import PROJECT_ROOT, load_stack

EXAMPLE_STACKS = ("local", "dev", "prod")
SCHEMAS = PROJECT_ROOT.parent / "shared" / "schemas" / "kuberay-v1.7.0"


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


@pytest.fixture(scope="session", params=EXAMPLE_STACKS)
def example_stack(request: pytest.FixtureRequest) -> StackSpec:
    return load_stack(request.param)


def stack_document(**overrides: object) -> dict:
    """A small valid stack document (one L4 group, one 8B model) with `llmstack:` overrides."""
    config: dict = {
        "aws:region": "us-east-1",
        "llmstack:cloud": {"provider": "aws", "availability_zones": ["us-east-1a", "us-east-1b"]},
        "llmstack:node_groups": [{"name": "l4", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": 2}],
        "llmstack:models": [{"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4",
                             "max_model_len": 8192}],
        "llmstack:redis": {"mode": "in_cluster"},
    }
    for key, value in overrides.items():
        config[f"llmstack:{key}"] = value
    return {"config": config}


def write_stack(folder: Path, name: str, document: dict) -> Path:
    import yaml

    path = folder / f"Pulumi.{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path
