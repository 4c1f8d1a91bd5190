"""The many-adapter benchmark's stack: tiny-chat alone at two replicas, twenty numbered tiny adapters
(folders `make dev` knows how to make), fewer vLLM slots and fewer adapters per replica than that,
and room for both replicas on the local node group."""

from __future__ import annotations

from infra.plan.planner import Reason, plan_stack
from infra.spec.model_source import local_folder
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.benchmarks.lora_adapters import stack_text
from ops.devstack.local_models import local_adapter_sources
from ops.devstack.tiny_adapter import recipe_for


def test_twenty_adapters_over_two_replicas_that_hold_fewer(tmp_path):
    path = tmp_path / "Pulumi.loramany.yaml"
    local = (PROJECT_ROOT / "Pulumi.local.yaml").read_text()
    path.write_text(stack_text(local, adapters=20, replicas=2, max_loras=4, per_replica=8))
    spec = load_stack(str(path))
    [model] = spec.models
    assert model.id == "tiny-chat" and (model.autoscaling.min_replicas, model.autoscaling.max_replicas) == (2, 2)
    assert model.lora is not None
    assert (model.lora.max_loras, model.lora.max_adapters_per_replica) == (4, 8)
    assert [a.id for a in model.lora.adapters] == [f"a{i:02d}" for i in range(1, 21)]
    # Every adapter folder is one make dev builds on first run (ops.devstack.local_models).
    folders = [local_folder(s).name for s in local_adapter_sources(spec)]
    assert folders[0] == "tiny-llama-a01" and len(set(folders)) == 20
    assert all(recipe_for(name) is not None for name in folders)
    # Both replicas and the ingress fit the local node group's logical CPUs; adapters not yet built
    # (a fresh checkout) are the only thing the plan may miss.
    assert [p for p in plan_stack(spec).problems if p.reason is not Reason.BAD_LORA_ADAPTER] == []
    assert spec.node_groups == load_stack("local").node_groups
