"""The `llmstack` namespace, which every rendered object lives in.

On AWS it carries the AWS Load Balancer Controller's pod readiness gate label. With it, the
controller's pod webhook adds a readiness gate to each gateway pod that turns true only once the
NLB reports the pod's IP target healthy, so a rolling update does not stop an old pod before
its replacement takes traffic (controller v2.14.0, helm templates/webhook.yaml: webhook
`mpod.elbv2.k8s.aws` selects namespaces labelled `elbv2.k8s.aws/pod-readiness-gate-inject:
enabled`). The Pulumi program creates this namespace after the controller is running, so the
webhook sees the gateway's first pods.
"""

from __future__ import annotations

from typing import Any

from infra.render.common import NAMESPACE, labels
from infra.spec.schema import StackSpec

READINESS_GATE_LABEL = "elbv2.k8s.aws/pod-readiness-gate-inject"


def namespace_object(spec: StackSpec) -> dict[str, Any]:
    names = labels("namespace", spec.name)
    if spec.cloud.provider == "aws":
        names[READINESS_GATE_LABEL] = "enabled"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE, "labels": names}}
