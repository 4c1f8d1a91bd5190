"""`llmctl scale` as a user runs it on copies of the example stacks: written only when the
plan passes, the follow-up said, clear errors and no tracebacks. The live apply on a running
`make dev` is in tests/e2e/test_llmctl_live.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.llmctl.scale.cli import applied, scale_changes


def llmctl(*args: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLMSTACK_STATE_DIR": str(state_dir)}
    return subprocess.run(
        [str(Path(sys.executable).parent / "llmctl"), *args],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        env=env,
        timeout=120,
    )


@pytest.fixture
def copy_of(tmp_path):
    def copy(stack: str) -> Path:
        target = tmp_path / f"Pulumi.{stack}.yaml"
        shutil.copy(PROJECT_ROOT / f"Pulumi.{stack}.yaml", target)
        return target

    return copy


def test_cloud_stack_written_with_cost_and_follow_up(copy_of, tmp_path):
    path = copy_of("dev")
    before = path.read_text()
    result = llmctl("scale", "--stack", str(path), "--model", "llama-3-1-8b", "--max", "3", state_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "llama-3-1-8b: max_replicas 2 -> 3" in result.stdout
    assert "$0.98 - $1.96 before, $0.98 - $2.93 after" in result.stdout  # one more g6.2xlarge at peak
    assert "make deploy STACK=dev" in result.stdout
    assert "blue/green upgrade in node group l4: fits -> fits only below peak load" in result.stdout
    assert "worker group l4: pods 1-2 -> 1-3; KubeRay does not copy" in result.stdout
    after = path.read_text()
    assert after == before.replace("max_replicas: 2\n", "max_replicas: 3\n", 1)
    assert load_stack(path).model("llama-3-1-8b").autoscaling.max_replicas == 3


def test_refused_by_the_plan_leaves_the_file_alone(copy_of, tmp_path):
    path = copy_of("dev")
    before = path.read_text()
    result = llmctl("scale", "--stack", str(path), "--model", "llama-3-1-8b", "--max", "9", state_dir=tmp_path)
    assert result.returncode == 1
    assert "node_group_too_small" in result.stderr and "not changed" in result.stderr
    assert path.read_text() == before


def test_min_above_max_names_the_key(copy_of, tmp_path):
    path = copy_of("dev")
    result = llmctl("scale", "--stack", str(path), "--model", "llama-3-1-8b", "--min", "3", state_dir=tmp_path)
    assert result.returncode == 2
    assert "Pulumi.dev.yaml" in result.stderr and "llmstack:models[0].autoscaling" in result.stderr
    assert "min_replicas 3 > max_replicas 2" in result.stderr and "Traceback" not in result.stderr


def test_unknown_model_and_nothing_to_change(copy_of, tmp_path):
    path = copy_of("prod")
    unknown = llmctl("scale", "--stack", str(path), "--model", "gpt-5", "--max", "2", state_dir=tmp_path)
    assert unknown.returncode == 2 and "no model with id 'gpt-5'" in unknown.stderr
    nothing = llmctl("scale", "--stack", str(path), "--model", "mistral-7b", state_dir=tmp_path)
    assert nothing.returncode == 2 and "nothing to change" in nothing.stderr


def test_dry_run_changes_nothing(copy_of, tmp_path):
    path = copy_of("prod")
    before = path.read_text()
    result = llmctl(
        "scale",
        "--stack",
        str(path),
        "--model",
        "mistral-7b",
        "--min",
        "1",
        "--target-ongoing",
        "8",
        "--dry-run",
        state_dir=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "min_replicas 0 -> 1, target_ongoing_requests 16 -> 8" in result.stdout and "dry run" in result.stdout
    assert path.read_text() == before


def test_local_stack_without_make_dev_is_written_for_the_next_start(copy_of, tmp_path):
    path = copy_of("local")
    result = llmctl(
        "scale",
        "--stack",
        str(path),
        "--model",
        "tiny-chat",
        "--target-ongoing",
        "8",
        state_dir=tmp_path / "no-dev-here",
    )
    assert result.returncode == 0, result.stderr
    assert "make dev is not running" in result.stdout and "next `make dev` uses the new values" in result.stdout
    assert load_stack(path).model("tiny-chat").autoscaling.target_ongoing_requests == 8


def test_scale_changes_keep_integers_integers():
    assert scale_changes(2, None, 8.0) == {"min_replicas": 2, "target_ongoing_requests": 8}
    assert scale_changes(None, 3, 2.5) == {"max_replicas": 3, "target_ongoing_requests": 2.5}


def test_applied_waits_for_bounds_and_replicas():
    model = load_stack("local").model("tiny-chat")  # min 1, max 1, target 16
    name = "LLMServer:tiny-chat"

    def app(min_r: int, running: int) -> dict:
        return {
            "deployments": {
                name: {
                    "deployment_config": {
                        "autoscaling_config": {
                            "min_replicas": min_r,
                            "max_replicas": 1,
                            "target_ongoing_requests": 16.0,
                        }
                    },
                    "replicas": [{"state": "RUNNING"}] * running + [{"state": "STARTING"}],
                }
            }
        }

    assert applied(app(1, 1), name, model)
    assert not applied(app(2, 1), name, model)  # Serve still has the old bounds
    assert not applied(app(1, 0), name, model)  # bounds applied, replica not up yet
    assert not applied(app(1, 2), name, model)  # scale-down not finished


def test_local_plan_counts_the_ingress_cpu(copy_of, tmp_path):
    """6 logical CPUs: two tiny models (2 each) and the OpenAI ingress (1) fit; a second
    tiny-chat replica would not, so the plan refuses it instead of leaving it pending."""
    path = copy_of("local")
    result = llmctl("scale", "--stack", str(path), "--model", "tiny-chat", "--max", "2", state_dir=tmp_path)
    assert result.returncode == 1
    assert "node_group_too_small" in result.stderr and "OpenAI ingress: 1" in result.stderr
    assert "cpus_per_node" in result.stderr
