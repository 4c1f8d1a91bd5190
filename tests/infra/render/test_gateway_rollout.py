"""The gateway Deployment leaves its replica count to the HorizontalPodAutoscaler: a `pulumi up`
after the HPA scaled out must not reset it (or fight the HPA's field manager)."""

from __future__ import annotations

import pytest

from infra.render import render_stack
from infra.spec.stack_file import load_stack
from tests.support.pulumi_program import example_run


@pytest.mark.parametrize("stack", ["local", "dev", "prod"])
def test_deployment_has_no_replicas_and_the_hpa_owns_them(stack: str) -> None:
    spec = load_stack(stack)
    objects = {o["kind"]: o for o in render_stack(spec) if o["metadata"]["name"] == "llmstack-gateway"}
    assert "replicas" not in objects["Deployment"]["spec"]
    hpa = objects["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llmstack-gateway"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (spec.gateway.min_replicas, spec.gateway.max_replicas)


def test_the_applied_deployment_has_no_replicas() -> None:
    deployment = example_run("prod").one("kubernetes:apps/v1:Deployment", "deployment-llmstack-gateway")
    assert "replicas" not in deployment.inputs["spec"]
