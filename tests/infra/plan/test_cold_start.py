"""Expected cold start per model, and the plan refusing a model that would time out while it starts."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from infra.plan.cold_start import (
    DISK_WRITE_BYTES_PER_S,
    IMAGE_PULL_S,
    LOCAL_ENGINE_START_S,
    NODE_BOOT_S,
    cold_start_timeout_s,
    default_timeout_s,
    expected_cold_start,
)
from infra.plan.planner import Reason, plan_stack
from infra.spec.stack_file import load_stack, spec_from_document
from tests.support.stacks import stack_document, write_stack


def spec_with(autoscaling: dict, *, cached: bool = False, min_size: int = 0):
    model = {
        "id": "llama",
        "source": "meta-llama/Llama-3.1-8B-Instruct",
        "node_group": "l4",
        "max_model_len": 8192,
        "autoscaling": autoscaling,
        "cached": cached,
    }
    groups = [{"name": "l4", "kind": "gpu", "instance_type": "g6.2xlarge", "min_size": min_size, "max_size": 2}]
    return spec_from_document(stack_document(models=[model], node_groups=groups), name="t", file_label="Pulumi.t.yaml")


def test_a_gpu_cold_start_is_the_sum_of_its_steps():
    spec = spec_with({"min_replicas": 0}, cached=True)
    weights = 16 * 1024**3
    cold = expected_cold_start(spec.models[0], spec.node_groups[0], weight_bytes=weights, spare_node=False)
    assert cold.node_boot_s == NODE_BOOT_S and cold.image_pull_s == IMAGE_PULL_S
    assert cold.weights_s == weights / DISK_WRITE_BYTES_PER_S and cold.weights_from == "s3 cache"
    parts = cold.scheduling_s + cold.node_boot_s + cold.image_pull_s + cold.weights_s + cold.engine_start_s
    assert cold.total_s == parts
    warm = expected_cold_start(spec.models[0], spec.node_groups[0], weight_bytes=weights, spare_node=True)
    assert warm.node_boot_s == 0 and warm.total_s == cold.total_s - NODE_BOOT_S
    # Weights larger than half the node's memory (g6.2xlarge: 32 GiB) load back from the disk.
    big = expected_cold_start(spec.models[0], spec.node_groups[0], weight_bytes=4 * weights, spare_node=False)
    assert big.engine_start_s - cold.engine_start_s > 3 * (cold.engine_start_s - 120)


def test_a_local_replica_needs_no_node_image_or_download():
    spec = load_stack("local")
    cold = expected_cold_start(spec.models[0], spec.node_groups[0], weight_bytes=10**7, spare_node=False)
    assert cold.total_s == LOCAL_ENGINE_START_S and cold.weights_from == "local"


def test_the_default_timeout_leaves_a_margin_and_an_explicit_one_wins():
    spec = spec_with({"min_replicas": 0})
    cold = expected_cold_start(spec.models[0], spec.node_groups[0], weight_bytes=16 * 1024**3, spare_node=False)
    assert default_timeout_s(cold) > cold.total_s and default_timeout_s(cold) % 60 == 0
    assert cold_start_timeout_s(spec.models[0], cold) == default_timeout_s(cold)
    explicit = spec_with({"min_replicas": 0, "cold_start_timeout_s": 1800})
    assert cold_start_timeout_s(explicit.models[0], cold) == 1800


def test_plan_shows_each_models_cold_start():
    plan = plan_stack(load_stack("prod"))
    assert plan.ok
    assert all(m.cold_start_s and m.cold_start_s > 0 for m in plan.models)
    # The 70B model moves ~131 GiB of weights through the node's disk: the slowest to start.
    slowest = max(plan.models, key=lambda m: m.cold_start_s)
    assert slowest.model_id == "llama-3-3-70b"


def test_plan_refuses_a_scale_to_zero_timeout_shorter_than_the_cold_start():
    refused = plan_stack(spec_with({"min_replicas": 0, "cold_start_timeout_s": 120}))
    problem = next(p for p in refused.problems if p.reason is Reason.COLD_START_TIMEOUT_TOO_SHORT)
    assert problem.subject == "llama"
    assert "Pulumi.t.yaml" in problem.message and "cold_start_timeout_s" in problem.message
    assert "image pull" in problem.message  # the breakdown tells which step to shorten
    # Replicas that never reach zero never make a request wait for a cold start.
    assert plan_stack(spec_with({"min_replicas": 1, "cold_start_timeout_s": 120})).ok
    assert plan_stack(spec_with({"min_replicas": 0})).ok  # the default always fits


def test_llmctl_plan_prints_the_cold_start_and_refuses_a_short_timeout(tmp_path):
    from ops.llmctl.main import app

    model = {
        "id": "llama",
        "source": "meta-llama/Llama-3.1-8B-Instruct",
        "node_group": "l4",
        "max_model_len": 8192,
        "autoscaling": {"min_replicas": 0, "cold_start_timeout_s": 60},
    }
    groups = [{"name": "l4", "kind": "gpu", "instance_type": "g6.2xlarge", "max_size": 2}]
    path = write_stack(tmp_path, "short", stack_document(models=[model], node_groups=groups))
    result = CliRunner().invoke(app, ["plan", "--stack", str(path)])
    assert result.exit_code == 1
    assert "cold start" in result.output and "cold_start_timeout_too_short" in result.output
    as_json = CliRunner().invoke(app, ["plan", "--stack", str(path), "--json"])
    document = json.loads(as_json.stdout)
    assert document["models"][0]["cold_start_timeout_s"] == 60
