"""Sizing the serving ingress (LLMRouter replicas) from the plan and the estimates file."""

from __future__ import annotations

import math

from infra.plan.ingress_plan import ServingEstimates, load_estimates, plan_ingress, replica_output_tokens_per_s
from infra.plan.planner import plan_stack
from infra.spec.stack_file import load_stack, spec_from_document
from tests.support.stacks import stack_document

ESTIMATES = ServingEstimates(
    reference_weight_bytes=16e9,
    router_cpu_ms_per_output_token=0.1,
    router_target_utilization=0.5,
    replica_output_tokens_per_s={"L4": 1000, "cpu": 100},
)  # one router: 5,000 tok/s


def planned(max_replicas: int, max_size: int = 8, estimates: ServingEstimates = ESTIMATES):
    doc = stack_document(
        node_groups=[{"name": "l4", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": max_size}],
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                "autoscaling": {"max_replicas": max_replicas},
            }
        ],
    )
    plan = plan_stack(spec_from_document(doc, name="t", file_label="t"))
    return plan, plan_ingress(plan.models, plan.node_groups, local=False, estimates=estimates)


def test_a_replica_is_the_class_figure_scaled_by_gpus_and_weight_bytes():
    plan, _ = planned(1)
    [model] = plan.models
    assert replica_output_tokens_per_s(model, ESTIMATES) == 1000 * 1 * 16e9 / model.weight_bytes


def test_routers_cover_the_peak_split_over_the_proxy_nodes():
    plan, ingress = planned(8)
    [model] = ingress.models
    assert ingress.router_output_tokens_per_s == 5000
    assert ingress.proxy_nodes_at_peak == 1 + plan.node_groups[0].nodes_at_max == 9  # head + one L4 node per replica
    assert model.routers_at_peak == math.ceil(model.peak_output_tokens_per_s / 5000)
    assert ingress.routers_per_node == math.ceil(model.routers_at_peak / 9)


def test_a_slow_router_gets_more_replicas_per_node():
    slow = ESTIMATES.model_copy(update={"router_cpu_ms_per_output_token": 5.0})  # 100 tok/s per router
    _, ingress = planned(8, estimates=slow)
    [model] = ingress.models
    assert model.routers_at_peak == math.ceil(model.peak_output_tokens_per_s / 100) > 9
    assert ingress.routers_per_node == math.ceil(model.routers_at_peak / 9) >= 2


def test_the_rendered_pods_get_the_planned_router_count():
    from infra.render.rayservice import rayservice

    slow = ESTIMATES.model_copy(update={"router_cpu_ms_per_output_token": 5.0})
    plan, ingress = planned(8, estimates=slow)
    doc = stack_document(
        node_groups=[{"name": "l4", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": 8}],
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                "autoscaling": {"max_replicas": 8},
            }
        ],
    )
    rendered = rayservice(
        spec_from_document(doc, name="t", file_label="t"), plan.model_copy(update={"ingress": ingress})
    )
    cluster = rendered["spec"]["rayClusterConfig"]
    for pod in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        env = {e["name"]: e.get("value") for e in pod["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_SERVE_INGRESS_ROUTER_REPLICAS_PER_NODE"] == str(ingress.routers_per_node)


def test_the_estimates_file_covers_every_gpu_class_and_the_plan_shows_it():
    load_estimates()  # validates: every GPU class of the catalog has a figure
    for stack in ("local", "dev", "prod"):
        ingress = plan_stack(load_stack(stack)).ingress
        assert ingress is not None and ingress.routers_per_node >= 1
        assert all(m.routers_at_peak >= 1 for m in ingress.models)
