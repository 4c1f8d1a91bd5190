"""The rendered namespace: on AWS it turns on the load balancer controller's pod readiness
gates, so a gateway rollout waits for the NLB to mark new pods healthy."""

from __future__ import annotations

import kubernetes_validate
import pytest

from infra.catalog.versions import KUBERNETES_VERSION
from infra.render import render_stack
from infra.spec.stack_file import load_stack
from tests.support.pulumi_program import example_run

GATE = "elbv2.k8s.aws/pod-readiness-gate-inject"


@pytest.mark.parametrize(("stack", "gated"), [("local", False), ("dev", True), ("prod", True)])
def test_namespace_is_rendered_first_with_the_readiness_gate_label_on_aws(stack: str, gated: bool) -> None:
    namespace, *rest = render_stack(load_stack(stack))
    assert (namespace["kind"], namespace["metadata"]["name"]) == ("Namespace", "llmstack")
    assert all(o["metadata"]["namespace"] == "llmstack" for o in rest)
    assert (namespace["metadata"]["labels"].get(GATE) == "enabled") is gated
    kubernetes_validate.validate(namespace, KUBERNETES_VERSION + ".0", strict=True)


def test_the_applied_namespace_carries_the_label_and_comes_after_the_controller() -> None:
    run = example_run("prod")
    namespace = run.one("kubernetes:core/v1:Namespace", "llmstack")
    assert namespace.inputs["metadata"]["labels"][GATE] == "enabled"
    controller = run.one("kubernetes:helm.sh/v4:Chart", "aws-load-balancer-controller")
    assert run.waits_for(namespace, controller)  # its pod webhook is serving before gateway pods exist
    gateway = run.one("kubernetes:apps/v1:Deployment", "deployment-llmstack-gateway")
    assert run.waits_for(gateway, namespace)
