"""Add-ons under Pulumi's mocks: the load balancer controller's webhooks cannot block the other
charts on a fresh cluster, and every version the stack spec pins reaches what is installed."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.spec.schema import Versions
from tests.support.pulumi_program import CLOUD_STACKS, ProgramRun, example_run, run_program
from tests.support.stacks import stack_document, write_stack

LB = "aws-load-balancer-controller"


@pytest.mark.parametrize("stack", [*CLOUD_STACKS, "karpenter"])
def test_no_chart_races_the_load_balancer_controllers_webhooks(stack: str) -> None:
    run = example_run(stack)
    charts = {c.name: c for c in run.of_type("kubernetes:helm.sh/v4:Chart")}
    # The Service mutating webhook fails closed and would intercept every chart's Services while
    # the controller's pods start (aws-load-balancer-controller#4140): it is not installed.
    assert charts[LB].inputs["values"]["enableServiceMutatorWebhook"] is False
    # ...and every other chart, the KubeRay namespace and ours wait for the controller anyway
    # (its pod webhook injects the gateway's readiness gates).
    for name, chart in charts.items():
        if name != LB:
            assert run.waits_for(chart, charts[LB]), name
    for namespace in run.of_type("kubernetes:core/v1:Namespace"):
        assert run.waits_for(namespace, charts[LB]), namespace.name


def test_the_gateway_is_still_handed_to_the_controller_without_the_webhook() -> None:
    """The webhook only defaulted `loadBalancerClass`; the annotation offloads the Service
    from the in-tree controller to this one (LBC docs, guide/service/nlb: Configuration)."""
    service = example_run("prod").one("kubernetes:core/v1:Service", "service-llmstack-gateway").inputs
    annotations = service["metadata"]["annotations"]
    assert annotations["service.beta.kubernetes.io/aws-load-balancer-type"] == "external"
    assert annotations["service.beta.kubernetes.io/aws-load-balancer-nlb-target-type"] == "ip"


def _pinned_run(tmp_path: Path) -> tuple[ProgramRun, Versions]:
    pins = Versions(
        gateway_image="registry.example.com/team/gw:9.9.9",
        serving_image="registry.example.com/team/serving:8.8.8",
        kuberay_operator="1.7.1",
    )
    document = stack_document(versions=pins.model_dump())
    write_stack(tmp_path, "pins", document)
    return run_program("pins", root=tmp_path), pins


def test_every_pin_in_the_spec_reaches_what_is_installed(tmp_path: Path) -> None:
    run, pins = _pinned_run(tmp_path)
    charts = {c.name: c.inputs for c in run.of_type("kubernetes:helm.sh/v4:Chart")}
    [rayservice] = run.of_type("kubernetes:ray.io/v1:RayService")
    cluster = rayservice.inputs["spec"]["rayClusterConfig"]
    ray_images = {
        c["image"]
        for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        for c in g["template"]["spec"]["containers"]
    }
    deployment = run.one("kubernetes:apps/v1:Deployment", "deployment-llmstack-gateway").inputs
    installed = {
        "kuberay_operator": charts["kuberay-operator"]["version"],
        "serving_image": ray_images,
        "gateway_image": {c["image"] for c in deployment["spec"]["template"]["spec"]["containers"]},
    }
    # A new pin without wiring fails here: every field of Versions must be accounted for.
    assert set(installed) == set(Versions.model_fields)
    assert installed == {
        "kuberay_operator": "1.7.1",
        "serving_image": {pins.serving_image},
        "gateway_image": {pins.gateway_image},
    }
