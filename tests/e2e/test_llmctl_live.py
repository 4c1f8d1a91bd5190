"""`llmctl status` and `llmctl scale` against a real `make dev` (Ray Serve, CPU vLLM, Redis,
gateway): the session's shared stack (tests/e2e/conftest.py).

Its stack file is a copy of Pulumi.local.yaml with 8 logical CPUs instead of 6, so a second
tiny-chat replica (two more) fits beside the others: the scale-up is real. The test proves the
change is applied in place: the replica that was running before keeps running (same replica id),
and comments in the stack file survive. The bounds are put back afterwards.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.spec.stack_file import load_stack
from tests.support.devstack import DevStack

pytestmark = pytest.mark.slow
TINY = "LLMServer:tiny-chat"


def status(dev: DevStack, stack_file: Path) -> dict:
    result = dev.llmctl("status", "--stack", str(stack_file), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def deployment(report: dict, name: str) -> dict:
    return next(d for d in report["deployments"] if d["deployment"] == name)


def replica_ids(dev: DevStack) -> set[str]:
    """Replica ids of tiny-chat that Serve reports RUNNING."""
    out = dev.ray_call(
        "import json; "
        f"print(json.dumps([r['replica_id'] for r in local_serve.details()['applications']['tiny-chat']"
        f"['deployments']['{TINY}']['replicas'] if r['state'] == 'RUNNING']))",
        timeout_s=120,
    )
    return set(json.loads(out))


def test_status_of_the_running_stack(dev_stack, e2e_stack_file):
    report = status(dev_stack, e2e_stack_file)
    assert report["health"] == "ok" and report["where"] == f"make dev, pid {dev_stack.process.pid}"
    checks = {c["component"]: c["health"] for c in report["checks"]}
    assert checks["gateway"] == checks["redis"] == "ok"
    assert checks["serve app tiny-chat"] == checks["serve app models"] == "ok"
    assert deployment(report, TINY)["replicas"] == {"RUNNING": 1}
    assert (deployment(report, TINY)["min_replicas"], deployment(report, TINY)["max_replicas"]) == (1, 1)


def test_scale_up_then_down_live_in_place(dev_stack, e2e_stack_file, restore_autoscaling):
    restore_autoscaling("tiny-chat")
    before_ids = replica_ids(dev_stack)
    result = dev_stack.llmctl(
        "scale", "--stack", str(e2e_stack_file), "--model", "tiny-chat", "--min", "2", "--max", "2"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applied" in result.stdout and f"pid {dev_stack.process.pid}" in result.stdout
    report = status(dev_stack, e2e_stack_file)
    tiny = deployment(report, TINY)
    assert tiny["replicas"] == {"RUNNING": 2} and (tiny["min_replicas"], tiny["max_replicas"]) == (2, 2)
    assert before_ids <= replica_ids(dev_stack), "the running replica was restarted: the change was not in place"
    assert deployment(report, "LLMServer:tiny-chat-ngram")["replicas"] == {"RUNNING": 1}
    text = e2e_stack_file.read_text()
    assert "# n-gram prompt lookup" in text and "cpus_per_node: 8" in text
    assert load_stack(e2e_stack_file).model("tiny-chat").autoscaling.min_replicas == 2

    result = dev_stack.llmctl(
        "scale",
        "--stack",
        str(e2e_stack_file),
        "--model",
        "tiny-chat",
        "--min",
        "1",
        "--max",
        "1",
        "--target-ongoing",
        "8",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    tiny = deployment(status(dev_stack, e2e_stack_file), TINY)
    assert tiny["replicas"].get("RUNNING") == 1 and (tiny["min_replicas"], tiny["max_replicas"]) == (1, 1)


def test_status_shows_which_replica_holds_an_adapter(dev_stack, e2e_stack_file):
    import openai

    from tests.support.waiting import eventually

    serve = openai.OpenAI(base_url=dev_stack.ready["model_urls"]["tiny-chat"], api_key="unused", max_retries=0)
    serve.chat.completions.create(
        model="tiny-chat:pirate", messages=[{"role": "user", "content": "hello"}], max_tokens=2
    )

    def pirate_rows() -> list[dict]:  # Ray exports the replica's gauge on its next metrics report
        return [a for a in status(dev_stack, e2e_stack_file)["adapters"] if a["adapter"] == "pirate"]

    [row] = eventually(pirate_rows, "llmctl status lists tiny-chat:pirate as loaded", poll_s=2)
    assert row["model"] == "tiny-chat" and row["node"]  # the node's address, as ray.nodes() gives it
    assert row["replica"] in replica_ids(dev_stack), "the adapter's replica is not one Serve runs"
    assert status(dev_stack, e2e_stack_file)["adapters_note"] is None  # every Ray node's metrics read
