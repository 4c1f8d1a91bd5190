"""The planner's KV-cache capacity against real CPU vLLM on the local stack's tiny model."""

from __future__ import annotations

import pytest

from infra.stack_file import PROJECT_ROOT
from ops.benchmarks.kv_capacity import measure


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["local", str(PROJECT_ROOT / "tests" / "stacks" / "Pulumi.draft.yaml")])
def test_planner_matches_vllm_within_five_percent(stack):
    results = [r for r in measure(stack) if "ratio" in r]
    assert results, "the local stack has CPU models to measure"
    for r in results:
        assert abs(r["ratio"] - 1) <= 0.05, r
