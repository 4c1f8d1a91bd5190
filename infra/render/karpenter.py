"""Karpenter's objects for a stack with `cloud.node_provisioner: karpenter` (pure).

One EC2NodeClass and one NodePool per GPU node group (Karpenter v1 API: karpenter.sh/v1,
karpenter.k8s.aws/v1; field names as in aws/karpenter-provider-aws website/content/en/v1.9/
concepts/nodepools.md and docs/concepts/nodeclasses.md):

- The NodePool allows every instance type of the group's GPU class that can hold the group's
  Ray worker pod (`infra.render.gpu_node_template.fallback_instance_types`): when the cheapest one is short
  in a zone (GPU capacity often is), Karpenter launches the next instead of leaving the pod
  Pending. Capacity type and zones come from the spec; `limits` caps the pool at
  `max_size` nodes' worth of GPUs.
- Nodes get the same labels and GPU taint as managed node groups (`infra.render.gpu_node_template`), so the
  rendered RayService needs no change.
- Consolidation only of empty nodes: Ray's autoscaler removes idle worker pods itself, and a
  node running a model replica must not be drained to save money (a replica reloads its
  weights). At most one node per pool is disrupted at a time (expiry, drift, interruption).
- The EC2NodeClass: the AL2023 AMI family (Karpenter picks its NVIDIA variant for GPU
  instances), the stack's private subnets and the cluster security group by ID, IMDSv2 with
  hop limit 1, an encrypted gp3 root volume of the group's disk size, and an instance profile
  the Pulumi program creates (so Karpenter needs no IAM instance-profile permissions).

The Pulumi program passes the IDs it knows only at deploy time; tests pass placeholders.
"""

from __future__ import annotations

from typing import Any

from infra.render.gpu_node_template import GPU_TAINT, fallback_instance_types, node_labels
from infra.spec.schema import AwsCloud, CapacityType, GpuNodeGroup, StackSpec

NODEPOOL_API = "karpenter.sh/v1"
NODECLASS_API = "karpenter.k8s.aws/v1"
AMI_ALIAS = "al2023@latest"
ROOT_DEVICE = "/dev/xvda"
EXPIRE_AFTER = "720h"  # nodes are replaced monthly: patched AMIs, no month-long drift
CONSOLIDATE_AFTER = "5m"


def resource_name(group: GpuNodeGroup) -> str:
    return f"llmstack-{group.name}"


def gpu_groups(spec: StackSpec) -> list[GpuNodeGroup]:
    return [g for g in spec.node_groups if isinstance(g, GpuNodeGroup)]


def node_class(
    spec: StackSpec,
    group: GpuNodeGroup,
    *,
    cluster_name: str,
    instance_profile: str,
    subnet_ids: list[str],
    security_group_ids: list[str],
) -> dict[str, Any]:
    return {
        "apiVersion": NODECLASS_API,
        "kind": "EC2NodeClass",
        "metadata": {"name": resource_name(group)},
        "spec": {
            "amiSelectorTerms": [{"alias": AMI_ALIAS}],
            "instanceProfile": instance_profile,
            "subnetSelectorTerms": [{"id": s} for s in subnet_ids],
            "securityGroupSelectorTerms": [{"id": g} for g in security_group_ids],
            "metadataOptions": {
                "httpEndpoint": "enabled",
                "httpProtocolIPv6": "disabled",
                "httpPutResponseHopLimit": 1,
                "httpTokens": "required",
            },
            "blockDeviceMappings": [
                {
                    "deviceName": ROOT_DEVICE,
                    "ebs": {
                        "volumeSize": f"{group.disk_size_gib}Gi",
                        "volumeType": "gp3",
                        "encrypted": True,
                        "deleteOnTermination": True,
                    },
                }
            ],
            "tags": {
                "Name": f"{cluster_name}-{group.name}",
                "llmstack.dev/stack": spec.name,
                "llmstack.dev/node-group": group.name,
            },
        },
    }


def node_pool(spec: StackSpec, group: GpuNodeGroup) -> dict[str, Any]:
    assert isinstance(spec.cloud, AwsCloud)
    gpus = group.instance.gpus
    capacity = "spot" if group.capacity_type is CapacityType.SPOT else "on-demand"
    return {
        "apiVersion": NODEPOOL_API,
        "kind": "NodePool",
        "metadata": {"name": resource_name(group)},
        "spec": {
            "template": {
                "metadata": {"labels": node_labels(group)},
                "spec": {
                    "nodeClassRef": {
                        "group": "karpenter.k8s.aws",
                        "kind": "EC2NodeClass",
                        "name": resource_name(group),
                    },
                    "requirements": [
                        {
                            "key": "node.kubernetes.io/instance-type",
                            "operator": "In",
                            "values": [t.instance_type for t in fallback_instance_types(group)],
                        },
                        {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [capacity]},
                        {
                            "key": "topology.kubernetes.io/zone",
                            "operator": "In",
                            "values": list(spec.cloud.availability_zones),
                        },
                        {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64"]},
                    ],
                    "taints": [GPU_TAINT],
                    "expireAfter": EXPIRE_AFTER,
                },
            },
            "limits": {"nvidia.com/gpu": str(group.max_size * gpus)},
            "disruption": {
                "consolidationPolicy": "WhenEmpty",
                "consolidateAfter": CONSOLIDATE_AFTER,
                "budgets": [{"nodes": "1"}],
            },
        },
    }


def karpenter_objects(
    spec: StackSpec, *, cluster_name: str, instance_profile: str, subnet_ids: list[str], security_group_ids: list[str]
) -> list[dict[str, Any]]:
    """EC2NodeClasses first (each NodePool names one), then NodePools."""
    groups = gpu_groups(spec)
    classes = [
        node_class(
            spec,
            g,
            cluster_name=cluster_name,
            instance_profile=instance_profile,
            subnet_ids=subnet_ids,
            security_group_ids=security_group_ids,
        )
        for g in groups
    ]
    return [*classes, *(node_pool(spec, g) for g in groups)]
