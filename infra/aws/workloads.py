"""The application: the `llmstack` namespace, the Hugging Face token, and the rendered objects.

The namespace, the RayService and the gateway objects are exactly what `llmctl render` prints
(`infra.render.render_stack`): each object's metadata and spec go to Kubernetes unchanged,
so a reviewer can read the manifests and know what `pulumi up` applies. This module only
picks the Pulumi resource type for each kind. The namespace is created on its own, first,
because Redis puts its Secrets in it before the workloads exist.

The gateway's Service is the stack's only load balancer; its hostname is the endpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.render.common import GATEWAY_NAME, HF_TOKEN_SECRET, NAMESPACE, labels
from infra.render.rayservice import with_gcs_redis_address

# (apiVersion, kind) of every rendered object -> the typed resource that applies it.
TYPED = {
    ("apps/v1", "Deployment"): k8s.apps.v1.Deployment,
    ("apps/v1", "DaemonSet"): k8s.apps.v1.DaemonSet,
    ("v1", "Service"): k8s.core.v1.Service,
    ("autoscaling/v2", "HorizontalPodAutoscaler"): k8s.autoscaling.v2.HorizontalPodAutoscaler,
    ("policy/v1", "PodDisruptionBudget"): k8s.policy.v1.PodDisruptionBudget,
    ("networking.k8s.io/v1", "NetworkPolicy"): k8s.networking.v1.NetworkPolicy,
    ("v1", "ConfigMap"): k8s.core.v1.ConfigMap,
}
CUSTOM = {("ray.io/v1", "RayService")}


def app_namespace(
    rendered: dict[str, Any], provider: k8s.Provider, opts: pulumi.ResourceOptions | None = None
) -> k8s.core.v1.Namespace:
    """The rendered namespace everything of ours lives in. Created first: Redis puts its Secrets here."""
    if (rendered["kind"], rendered["metadata"]["name"]) != ("Namespace", NAMESPACE):
        raise ValueError(f"expected the rendered Namespace {NAMESPACE!r}, got {rendered['kind']}")
    return k8s.core.v1.Namespace(
        NAMESPACE,
        metadata=rendered["metadata"],
        opts=pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(provider=provider)),
    )


@dataclass
class WorkloadsArgs:
    stack: str
    objects: list[dict[str, Any]]
    """`render_stack(spec)` without the Namespace (`app_namespace`): applied as they are."""
    tls: bool
    namespace: k8s.core.v1.Namespace
    k8s_provider: k8s.Provider
    hf_token: pulumi.Input[str] | None = None
    gcs_redis_address: pulumi.Input[str] | None = None
    """Set for managed Redis: replaces the rendered GCS address once the endpoint exists."""


class Workloads(pulumi.ComponentResource):
    endpoint_url: pulumi.Output[str]

    def __init__(self, name: str, args: WorkloadsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:Workloads", name, None, opts)
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.k8s_provider, depends_on=[args.namespace])
        after: list[pulumi.Resource] = []
        if args.hf_token is not None:
            after.append(
                k8s.core.v1.Secret(
                    HF_TOKEN_SECRET,
                    metadata={"name": HF_TOKEN_SECRET, "namespace": NAMESPACE, "labels": labels("ray", args.stack)},
                    string_data={"token": pulumi.Output.secret(args.hf_token)},
                    opts=k8s_opts,
                )
            )
        opts_after = pulumi.ResourceOptions.merge(k8s_opts, pulumi.ResourceOptions(depends_on=after))

        gateway: Any = None  # the Service: pulumi_kubernetes's own types are not read by mypy
        for obj in args.objects:
            if obj["kind"] == "RayService" and args.gcs_redis_address is not None:
                spec = pulumi.Output.from_input(args.gcs_redis_address).apply(
                    partial(with_gcs_redis_address, obj["spec"])
                )
                obj = {**obj, "spec": spec}
            resource = apply_object(obj, opts_after)
            if obj["kind"] == "Service" and obj["metadata"]["name"] == GATEWAY_NAME:
                gateway = resource
        if gateway is None:
            raise ValueError(f"the rendered objects have no Service {GATEWAY_NAME!r}: nothing to export as endpoint")
        scheme = "https" if args.tls else "http"
        hostname = gateway.status.apply(lambda s: s.load_balancer.ingress[0].hostname)
        self.endpoint_url = pulumi.Output.concat(scheme, "://", hostname)
        self.register_outputs({"endpoint_url": self.endpoint_url})


def apply_object(obj: dict[str, Any], opts: pulumi.ResourceOptions) -> pulumi.CustomResource:
    """One rendered object as a Pulumi resource, metadata and spec (a ConfigMap's data) passed through unchanged."""
    key = (obj["apiVersion"], obj["kind"])
    name = f"{obj['kind'].lower()}-{obj['metadata']['name']}"
    if key in CUSTOM:
        return k8s.apiextensions.CustomResource(
            name, api_version=obj["apiVersion"], kind=obj["kind"], metadata=obj["metadata"], spec=obj["spec"], opts=opts
        )
    if key not in TYPED:
        raise ValueError(
            f"rendered object {name} has apiVersion/kind {key}, which infra/aws/workloads.py "
            "does not know how to apply; add it to TYPED"
        )
    if key == ("v1", "ConfigMap"):
        return TYPED[key](name, metadata=obj["metadata"], data=obj["data"], opts=opts)
    return TYPED[key](name, metadata=obj["metadata"], spec=obj["spec"], opts=opts)
