"""Cluster add-ons, as pinned Helm charts (and one EKS add-on), each with only the IAM it needs.

- NVIDIA device plugin: advertises `nvidia.com/gpu` on GPU nodes (tolerates their taint).
- Cluster Autoscaler (with `node_provisioner: cluster-autoscaler`): adds GPU nodes when Ray
  workers are Pending, removes idle ones; IRSA role may scale only groups tagged as this
  cluster's. Its minor version follows the cluster's (`infra.catalog.versions`). With `karpenter`,
  `karpenter.py` starts GPU nodes instead.
- AWS Load Balancer Controller: turns the gateway Service (annotated `external`, IP targets)
  into an NLB; the in-tree controller ignores such Services. Its Service mutating webhook is
  off: it would only default `loadBalancerClass` (the annotation already hands the gateway to
  the controller), and it fails closed, so on a fresh cluster every other chart's Service is
  refused while the controller's pods are still starting (aws-load-balancer-controller#4140).
  Every other chart, and our namespace, also waits for the controller's chart to be ready: its
  pod webhook injects the gateway's readiness gates and must be serving first.
- metrics-server: CPU metrics for the gateway's HorizontalPodAutoscaler.
- KubeRay operator: runs the RayService (its CRDs must exist before the RayService).
- EBS CSI driver (EKS add-on) and an encrypted gp3 StorageClass: volumes for in-cluster Redis.
- VPC CNI (EKS add-on) with network policy enforcement on: without it the rendered
  NetworkPolicy that fences Ray off from everything but the gateway is silently ignored.

Chart versions live in `infra.catalog.versions`, with where each was checked; the KubeRay operator's
follows the stack's `versions.kuberay_operator`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.aws.iam import cluster_autoscaler_policy, irsa_role, load_balancer_controller_policy
from infra.catalog.versions import (
    CLUSTER_AUTOSCALER_CHART,
    CLUSTER_AUTOSCALER_IMAGE_TAGS,
    KUBERAY_OPERATOR_CHART,
    LOAD_BALANCER_CONTROLLER_CHART,
    METRICS_SERVER_CHART,
    NVIDIA_DEVICE_PLUGIN_CHART,
    Chart,
)
from infra.render.common import KUBERAY_NAMESPACE, NODE_GROUP_LABEL
from infra.render.gpu_node_template import GPU_PRESENT_LABEL

EBS_CSI_POLICY = "arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"
STORAGE_CLASS = "llmstack-gp3-encrypted"
SYSTEM_NODES = {NODE_GROUP_LABEL: "system"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@dataclass
class AddonsArgs:
    cluster_name: str
    kubernetes_version: str
    region: str
    vpc_id: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]
    k8s_provider: k8s.Provider
    kuberay_version: str
    """The stack's `versions.kuberay_operator`."""
    cluster_autoscaler: bool = True
    """False when Karpenter provisions GPU nodes."""


class Addons(pulumi.ComponentResource):
    def __init__(self, name: str, args: AddonsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:Addons", name, None, opts)
        aws_opts = pulumi.ResourceOptions(parent=self)
        self._k8s = pulumi.ResourceOptions(parent=self, provider=args.k8s_provider)

        def role(
            service: str,
            account: str,
            *,
            policy: pulumi.Input[str] | None = None,
            managed_policy_arn: str | None = None,
        ) -> aws.iam.Role:
            return irsa_role(
                f"{name}-{service}",
                oidc_provider_arn=args.oidc_provider_arn,
                oidc_issuer=args.oidc_issuer,
                namespace="kube-system",
                service_account=account,
                policy=policy,
                managed_policy_arn=managed_policy_arn,
                opts=aws_opts,
            )

        lb_controller = role(
            "lb-controller",
            "aws-load-balancer-controller",
            policy=load_balancer_controller_policy(args.cluster_name, args.vpc_id),
        )
        ebs_csi = role("ebs-csi", "ebs-csi-controller-sa", managed_policy_arn=EBS_CSI_POLICY)

        self.load_balancer_controller = self._chart(
            "aws-load-balancer-controller",
            LOAD_BALANCER_CONTROLLER_CHART,
            "kube-system",
            {
                "clusterName": args.cluster_name,
                "region": args.region,
                "vpcId": args.vpc_id,
                "serviceAccount": _service_account("aws-load-balancer-controller", lb_controller),
                "enableServiceMutatorWebhook": False,
                "nodeSelector": SYSTEM_NODES,
            },
        )
        # Everything else waits for the controller (see the module docstring).
        after_lb = pulumi.ResourceOptions(depends_on=[self.load_balancer_controller])
        charts = [self.load_balancer_controller]
        charts.append(
            self._chart(
                "nvidia-device-plugin",
                NVIDIA_DEVICE_PLUGIN_CHART,
                "kube-system",
                {
                    "tolerations": [GPU_TOLERATION],
                    "nodeSelector": {GPU_PRESENT_LABEL: "true"},
                },
                after_lb,
            )
        )
        if args.cluster_autoscaler:
            autoscaler = role(
                "cluster-autoscaler", "cluster-autoscaler", policy=cluster_autoscaler_policy(args.cluster_name)
            )
            charts.append(
                self._chart(
                    "cluster-autoscaler",
                    CLUSTER_AUTOSCALER_CHART,
                    "kube-system",
                    {
                        "cloudProvider": "aws",
                        "awsRegion": args.region,
                        "autoDiscovery": {"clusterName": args.cluster_name},
                        "image": {"tag": CLUSTER_AUTOSCALER_IMAGE_TAGS[args.kubernetes_version]},
                        "rbac": {"serviceAccount": _service_account("cluster-autoscaler", autoscaler)},
                        "extraArgs": {
                            "balance-similar-node-groups": True,
                            "expander": "least-waste",
                            "skip-nodes-with-system-pods": False,
                        },
                        "nodeSelector": SYSTEM_NODES,
                    },
                    after_lb,
                )
            )
        charts.append(
            self._chart("metrics-server", METRICS_SERVER_CHART, "kube-system", {"nodeSelector": SYSTEM_NODES}, after_lb)
        )
        namespace = k8s.core.v1.Namespace(
            KUBERAY_NAMESPACE,
            metadata={"name": KUBERAY_NAMESPACE},
            opts=pulumi.ResourceOptions.merge(self._k8s, after_lb),
        )
        kuberay = KUBERAY_OPERATOR_CHART._replace(version=args.kuberay_version)
        charts.append(
            self._chart(
                "kuberay-operator",
                kuberay,
                KUBERAY_NAMESPACE,
                {"nodeSelector": SYSTEM_NODES},
                pulumi.ResourceOptions(depends_on=[namespace, self.load_balancer_controller]),
            )
        )
        self.charts = charts

        aws.eks.Addon(
            f"{name}-vpc-cni",
            cluster_name=args.cluster_name,
            addon_name="vpc-cni",
            configuration_values=json.dumps({"enableNetworkPolicy": "true"}),
            resolve_conflicts_on_create="OVERWRITE",
            resolve_conflicts_on_update="OVERWRITE",
            opts=aws_opts,
        )
        ebs_addon = aws.eks.Addon(
            f"{name}-ebs-csi",
            cluster_name=args.cluster_name,
            addon_name="aws-ebs-csi-driver",
            service_account_role_arn=ebs_csi.arn,
            opts=aws_opts,
        )
        k8s.storage.v1.StorageClass(
            STORAGE_CLASS,
            metadata={"name": STORAGE_CLASS},
            provisioner="ebs.csi.aws.com",
            parameters={"type": "gp3", "encrypted": "true"},
            volume_binding_mode="WaitForFirstConsumer",
            reclaim_policy="Delete",
            allow_volume_expansion=True,
            opts=pulumi.ResourceOptions.merge(self._k8s, pulumi.ResourceOptions(depends_on=[ebs_addon])),
        )
        self.register_outputs({})

    def _chart(
        self, name: str, pin: Chart, namespace: str, values: dict, opts: pulumi.ResourceOptions | None = None
    ) -> k8s.helm.v4.Chart:
        repo, chart, version = pin
        return k8s.helm.v4.Chart(
            name,
            chart=chart,
            version=version,
            namespace=namespace,
            repository_opts=k8s.helm.v4.RepositoryOptsArgs(repo=repo),
            values=values,
            opts=pulumi.ResourceOptions.merge(self._k8s, opts),
        )


def _service_account(name: str, role: aws.iam.Role) -> dict:
    """Chart values for a service account that assumes `role` (IRSA)."""
    return {"create": True, "name": name, "annotations": {"eks.amazonaws.com/role-arn": role.arn}}
