"""Each model's latency target in the stack file, the defaults derived from the planner's
throughput estimate, and what the gateway gets per model (infra.plan.latency_target)."""

from __future__ import annotations

import json

import pytest

from infra.plan.latency_target import ITL_FLOOR_MS, default_itl_ms, model_capacities
from infra.plan.planner import plan_stack
from infra.spec.stack_file import StackFileError, load_stack, spec_from_document
from serving.gateway.config.capacity_policy import ModelCapacity
from tests.support.stacks import stack_document

LLAMA = {"id": "llama", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 8192}


def capacities(models=None, node_groups=None):
    overrides = {"models": models or [LLAMA]}
    if node_groups:
        overrides["node_groups"] = node_groups
    spec = spec_from_document(stack_document(**overrides), name="t", file_label="Pulumi.t.yaml")
    return model_capacities(spec, plan_stack(spec))


def test_the_default_itl_is_three_times_a_full_replicas_gap_and_never_under_the_floor():
    assert default_itl_ms(64, 1120) == 171  # 8B on one L4: 64 streams at 1,120 tokens/s share 57 ms steps
    assert default_itl_ms(64, 12_500) == ITL_FLOOR_MS  # on an H100 three gaps are 15 ms: the floor
    assert default_itl_ms(1, 1_000_000) == ITL_FLOOR_MS


def test_defaults_follow_the_gpu_class_from_the_plans_estimate():
    spec = spec_from_document(stack_document(models=[LLAMA]), name="t", file_label="Pulumi.t.yaml")
    plan = plan_stack(spec)
    [ingress] = plan.ingress.models
    [(name, capacity)] = model_capacities(spec, plan).items()
    assert name == "llama"
    expected_itl = round(3 * 1000 * 64 / ingress.replica_output_tokens_per_s)
    assert capacity == ModelCapacity(
        ttft_ms=8 * expected_itl, itl_ms=expected_itl, percentile=90, adaptive=True, min_slots=2, max_slots=64
    )
    # A faster GPU class gets a tighter default, down to the floor.
    h100 = [{"name": "l4", "kind": "gpu", "instance_type": "p5.48xlarge", "max_size": 1}]
    fast = capacities(node_groups=h100)["llama"]
    assert fast.itl_ms == ITL_FLOOR_MS < capacity.itl_ms and fast.ttft_ms == 8 * ITL_FLOOR_MS


def test_stated_targets_win_and_the_bounds_come_from_autoscaling():
    model = {
        **LLAMA,
        "served_name": "meta/llama",
        "latency_target": {"itl_ms": 90, "percentile": 99, "min_slots": 4},
        "autoscaling": {"max_ongoing_requests": 24, "target_ongoing_requests": 8},
    }
    assert capacities([model]) == {
        "meta/llama": ModelCapacity(ttft_ms=720, itl_ms=90, percentile=99, min_slots=4, max_slots=24)
    }
    both = {**LLAMA, "latency_target": {"ttft_ms": 500, "itl_ms": 40, "adaptive": False}}
    assert capacities([both])["llama"] == ModelCapacity(ttft_ms=500, itl_ms=40, adaptive=False, max_slots=64)
    # A floor above the ceiling is the ceiling: the capacity then never moves.
    high_floor = {**LLAMA, "latency_target": {"min_slots": 100}}
    assert capacities([high_floor])["llama"].min_slots == 64


def test_make_devs_stack_states_cpu_sized_targets():
    spec = load_stack("local")
    for capacity in model_capacities(spec, plan_stack(spec)).values():
        assert (capacity.ttft_ms, capacity.itl_ms, capacity.percentile) == (300, 80, 90)
        assert capacity.adaptive and capacity.max_slots == 64


@pytest.mark.parametrize(
    "target",
    [
        {"percentile": 100},
        {"percentile": 50},
        {"ttft_ms": 0},
        {"itl_ms": -1},
        {"min_slots": 0},
        {"ttft": 300},
        {"adaptive": "sometimes"},
    ],
)
def test_a_bad_latency_target_is_refused_at_its_key(target):
    document = stack_document(models=[{**LLAMA, "latency_target": target}])
    with pytest.raises(StackFileError, match="latency_target"):
        spec_from_document(document, name="t", file_label="Pulumi.t.yaml")


def test_what_is_rendered_is_what_the_gateway_validates():
    rendered = json.loads(json.dumps({name: c.model_dump(mode="json") for name, c in capacities().items()}))
    assert {name: ModelCapacity.model_validate(c) for name, c in rendered.items()} == capacities()
