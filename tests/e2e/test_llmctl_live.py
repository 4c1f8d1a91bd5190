"""`llmctl status` and `llmctl scale` against a real `make dev` (Ray Serve, CPU vLLM, Redis,
gateway): one stack start for the whole module.

The stack is a copy of Pulumi.local.yaml with 8 logical CPUs instead of 6, so a second
tiny-chat replica (two more) fits beside the ingress and the other model: the scale-up is real.
The test proves the change is applied in place: the replica that was running before keeps
running (same replica id), and comments in the stack file survive.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from infra.stack_file import PROJECT_ROOT, load_stack
from tests.support.devstack import DevStack

pytestmark = pytest.mark.slow
TINY = "LLMServer:tiny-chat"


@pytest.fixture(scope="module")
def stack_file():
    folder = Path(tempfile.mkdtemp(prefix="llmstack-ops-"))
    path = folder / "Pulumi.local.yaml"
    text = (PROJECT_ROOT / "Pulumi.local.yaml").read_text()
    assert "cpus_per_node: 6" in text
    path.write_text(text.replace("cpus_per_node: 6", "cpus_per_node: 8"))
    yield path
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def dev(stack_file):
    stack = DevStack(str(stack_file))
    try:
        yield stack
    finally:
        assert stack.stop() == 0
        assert not [pid for pid in stack.descendants if psutil.pid_exists(pid)
                    and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


def llmctl(dev: DevStack, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(Path(sys.executable).parent / "llmctl"), *args], capture_output=True, text=True,
                          cwd=PROJECT_ROOT, env=dev.env, timeout=900)


def status(dev: DevStack, stack_file: Path) -> dict:
    result = llmctl(dev, "status", "--stack", str(stack_file), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def deployment(report: dict, name: str) -> dict:
    return next(d for d in report["deployments"] if d["deployment"] == name)


def replica_ids(dev: DevStack) -> set[str]:
    """Replica ids of tiny-chat, read from Serve in a child process (this process stays Ray-free)."""
    code = ("import json; from ops.devstack.lock import find_running_dev; "
            "from ops.devstack import serve as local_serve; "
            "d = find_running_dev(); local_serve.connect(d.ray_address, d.ray_auth_mode); "
            f"print(json.dumps([r['replica_id'] for r in local_serve.details()['applications']['tiny-chat']"
            f"['deployments']['{TINY}']['replicas'] if r['state'] == 'RUNNING']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dev.env, cwd=PROJECT_ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_status_of_the_running_stack(dev, stack_file):
    report = status(dev, stack_file)
    assert report["health"] == "ok" and report["where"] == f"make dev, pid {dev.process.pid}"
    checks = {c["component"]: c["health"] for c in report["checks"]}
    assert checks["gateway"] == checks["redis"] == "ok"
    assert checks["serve app tiny-chat"] == checks["serve app models"] == "ok"
    assert deployment(report, TINY)["replicas"] == {"RUNNING": 1}
    assert (deployment(report, TINY)["min_replicas"], deployment(report, TINY)["max_replicas"]) == (1, 1)


def test_scale_up_live_in_place(dev, stack_file):
    before_ids = replica_ids(dev)
    result = llmctl(dev, "scale", "--stack", str(stack_file), "--model", "tiny-chat", "--min", "2", "--max", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applied" in result.stdout and f"pid {dev.process.pid}" in result.stdout
    report = status(dev, stack_file)
    tiny = deployment(report, TINY)
    assert tiny["replicas"] == {"RUNNING": 2} and (tiny["min_replicas"], tiny["max_replicas"]) == (2, 2)
    assert before_ids <= replica_ids(dev), "the running replica was restarted: the change was not in place"
    assert deployment(report, "LLMServer:tiny-chat-ngram")["replicas"] == {"RUNNING": 1}
    text = stack_file.read_text()
    assert "# n-gram prompt lookup" in text and "cpus_per_node: 8" in text
    assert load_stack(stack_file).model("tiny-chat").autoscaling.min_replicas == 2


def test_scale_down_live(dev, stack_file):
    result = llmctl(dev, "scale", "--stack", str(stack_file), "--model", "tiny-chat", "--min", "1", "--max", "1",
                    "--target-ongoing", "8")
    assert result.returncode == 0, result.stdout + result.stderr
    tiny = deployment(status(dev, stack_file), TINY)
    assert tiny["replicas"].get("RUNNING") == 1 and (tiny["min_replicas"], tiny["max_replicas"]) == (1, 1)
