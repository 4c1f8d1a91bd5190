"""`llmctl plan` and `llmctl render` as a user runs them: exit codes, messages, no tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from infra.spec.stack_file import PROJECT_ROOT
from tests.support.stacks import stack_document, write_stack


def llmctl(*args: str) -> subprocess.CompletedProcess[str]:
    # The installed console script, as users run it (an entry point of the package).
    executable = Path(sys.executable).parent / "llmctl"
    return subprocess.run([str(executable), *args], capture_output=True, text=True, cwd=PROJECT_ROOT, timeout=120)


@pytest.mark.parametrize("stack", ["local", "dev", "prod"])
def test_plan_json_for_examples(stack):
    result = llmctl("plan", "--stack", stack, "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["ok"] and plan["stack"] == stack and plan["models"]


def test_plan_table_shows_cost():
    result = llmctl("plan", "--stack", "dev")
    assert result.returncode == 0
    assert "llama-3-1-8b" in result.stdout and "$" in result.stdout and "plan ok" in result.stdout


def test_plan_shows_each_models_latency_target_stated_or_derived():
    stated = json.loads(llmctl("plan", "--stack", "local", "--json").stdout)["latency_targets"]
    assert stated["tiny-chat"] == {  # Pulumi.local.yaml states it
        "ttft_ms": 300.0,
        "itl_ms": 80.0,
        "percentile": 90.0,
        "adaptive": True,
        "min_slots": 2,
        "max_slots": 64,
    }
    derived = json.loads(llmctl("plan", "--stack", "dev", "--json").stdout)["latency_targets"]
    assert derived and all(t["ttft_ms"] == 8 * t["itl_ms"] and t["itl_ms"] >= 50 for t in derived.values())
    table = llmctl("plan", "--stack", "local").stdout
    assert "latency targets" in table and "300 ms" in table and "80 ms" in table


def test_bad_stack_file_exits_2_with_message_not_traceback(tmp_path):
    path = write_stack(
        tmp_path, "bad", stack_document(node_groups=[{"name": "l4", "kind": "gpu", "gpu_class": "T4", "max_size": 1}])
    )
    result = llmctl("plan", "--stack", str(path))
    assert result.returncode == 2
    assert "Pulumi.bad.yaml" in result.stderr and "llmstack:node_groups[0].gpu_class" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_invalid_yaml_exits_2(tmp_path):
    path = tmp_path / "Pulumi.broken.yaml"
    path.write_text("config:\n  llmstack:models: [\n")
    result = llmctl("plan", "--stack", str(path))
    assert result.returncode == 2 and "not valid YAML" in result.stderr and "Traceback" not in result.stderr


def test_impossible_plan_exits_1_with_reason(tmp_path):
    doc = stack_document(
        models=[{"id": "m", "source": "meta-llama/Llama-3.1-8B-Instruct", "node_group": "l4", "max_model_len": 131072}]
    )
    path = write_stack(tmp_path, "tight", doc)
    plan = llmctl("plan", "--stack", str(path))
    assert plan.returncode == 1 and "no_room_for_one_sequence" in plan.stderr
    render = llmctl("render", "--stack", str(path), "--out", str(tmp_path / "out"))
    assert render.returncode == 1 and "not rendered" in render.stderr
    assert not (tmp_path / "out").exists()


def test_render_writes_one_file_per_object(tmp_path):
    result = llmctl("render", "--stack", "prod", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "rayservice-llmstack.yaml" in files and "deployment-llmstack-gateway.yaml" in files
    assert yaml.safe_load((tmp_path / "rayservice-llmstack.yaml").read_text())["kind"] == "RayService"


def test_render_to_stdout_is_multi_document_yaml():
    result = llmctl("render", "--stack", "dev", "--out", "-")
    assert result.returncode == 0
    assert [d["kind"] for d in yaml.safe_load_all(result.stdout)][:2] == ["Namespace", "RayService"]
