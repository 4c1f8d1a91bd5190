"""The planner's KV-cache capacity against what CPU vLLM itself allocates: the local stack's
models as the shared dev stack's engines sized their caches, and the draft-model stack's model in
an offline engine of its own (a draft model's cache shares the model's space)."""

from __future__ import annotations

import pytest

from infra.plan.planner import plan_stack
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.benchmarks.kv_capacity import measure

pytestmark = pytest.mark.slow


def test_planner_matches_the_running_engines_of_the_local_stack_within_five_percent(dev_stack, e2e_stack_file):
    local = {p.model_id: p.kv_tokens_per_replica for p in plan_stack(load_stack("local")).models}
    # The shared stack differs from Pulumi.local.yaml in CPUs and autoscaling only: same caches.
    assert {p.model_id: p.kv_tokens_per_replica for p in plan_stack(load_stack(e2e_stack_file)).models} == local
    engines = dev_stack.engine_kv_tokens()
    assert sorted(engines) == sorted(local), "every model's engine reported its KV cache size"
    for model, planned in local.items():
        [measured] = engines[model]  # every replica of a model sizes the same cache
        assert abs(planned / measured - 1) <= 0.05, (model, planned, measured)


def test_planner_matches_vllm_with_a_draft_model_within_five_percent():
    results = [r for r in measure(str(PROJECT_ROOT / "tests" / "stacks" / "Pulumi.draft.yaml")) if "ratio" in r]
    assert [r["model"] for r in results] == ["tiny-draft"]
    for r in results:
        assert abs(r["ratio"] - 1) <= 0.05, r
