"""One EKS managed node group per GPU node group of the stack, ready to scale from zero.

Each group runs the AL2023 NVIDIA AMI (driver and container toolkit included; the device
plugin comes from `addons.py`), carries the labels the rendered RayService selects on, and
is tainted so only pods that tolerate GPUs land there.

Scale from zero: with no node running, the Cluster Autoscaler learns what a new node would
offer from tags on the group's Auto Scaling group (`node-template/label/...`, `/taint/...`,
`/resources/nvidia.com/gpu`). Tags on a managed node group do not propagate to its ASG, so
they are set on the ASG itself, one `aws.autoscaling.Tag` each. Without them a Ray worker
that asks for `nvidia.com/gpu` stays Pending forever on a group at size zero. The labels include
the autoscaler's GPU label (`infra.render.gpu_node_template`), so a new node waiting for its device plugin is not
mistaken for one without GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.aws.launch_template import hardened_launch_template
from infra.render.common import NODE_GROUP_LABEL
from infra.render.gpu_node_template import GPU_TAINT, node_labels
from infra.spec.schema import CapacityType, GpuNodeGroup

AMI_TYPE = "AL2023_x86_64_NVIDIA"
AUTOSCALER_TEMPLATE = "k8s.io/cluster-autoscaler/node-template"


@dataclass
class GpuNodeGroupsArgs:
    cluster_name: str
    node_role_arn: pulumi.Input[str]
    subnet_ids: pulumi.Input[list[str]]
    groups: list[GpuNodeGroup]


def autoscaler_tags(group: GpuNodeGroup, cluster_name: str) -> dict[str, str]:
    """The ASG tags the Cluster Autoscaler reads for discovery and for scale-from-zero templates."""
    gpus = group.instance.gpus
    tags = {f"{AUTOSCALER_TEMPLATE}/label/{key}": value for key, value in node_labels(group).items()}
    tags[f"{AUTOSCALER_TEMPLATE}/taint/{GPU_TAINT['key']}"] = f"{GPU_TAINT['value']}:{GPU_TAINT['effect']}"
    tags[f"{AUTOSCALER_TEMPLATE}/resources/nvidia.com/gpu"] = str(gpus)
    tags["k8s.io/cluster-autoscaler/enabled"] = "true"
    tags[f"k8s.io/cluster-autoscaler/{cluster_name}"] = "owned"
    return tags


class GpuNodeGroups(pulumi.ComponentResource):
    node_groups: dict[str, aws.eks.NodeGroup]

    def __init__(self, name: str, args: GpuNodeGroupsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:GpuNodeGroups", name, None, opts)
        self.node_groups = {group.name: self._group(name, group, args) for group in args.groups}
        self.register_outputs({"node_groups": {k: v.node_group_name for k, v in self.node_groups.items()}})

    def _group(self, prefix: str, group: GpuNodeGroup, args: GpuNodeGroupsArgs) -> aws.eks.NodeGroup:
        name = f"{prefix}-{group.name}"
        child = pulumi.ResourceOptions(parent=self)
        template = hardened_launch_template(
            name, disk_size_gib=group.disk_size_gib, tags={"Name": f"{args.cluster_name}-{group.name}"}, opts=child
        )
        node_group = aws.eks.NodeGroup(
            name,
            cluster_name=args.cluster_name,
            node_group_name=group.name,
            node_role_arn=args.node_role_arn,
            subnet_ids=args.subnet_ids,
            ami_type=AMI_TYPE,
            instance_types=[group.instance_type],
            capacity_type="SPOT" if group.capacity_type is CapacityType.SPOT else "ON_DEMAND",
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(
                min_size=group.min_size, desired_size=group.desired, max_size=group.max_size
            ),
            update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
            labels=node_labels(group),
            taints=[aws.eks.NodeGroupTaintArgs(key=GPU_TAINT["key"], value=GPU_TAINT["value"], effect="NO_SCHEDULE")],
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(
                id=template.id, version=template.latest_version.apply(str)
            ),
            tags={NODE_GROUP_LABEL: group.name},
            # After creation the Cluster Autoscaler owns the node count, not `pulumi up`.
            opts=pulumi.ResourceOptions(parent=self, ignore_changes=["scalingConfig.desiredSize"]),
        )
        asg_name = node_group.resources.apply(lambda r: r[0].autoscaling_groups[0].name)
        for key, value in autoscaler_tags(group, args.cluster_name).items():
            aws.autoscaling.Tag(
                f"{name}-asg-{_slug(key)}",
                autoscaling_group_name=asg_name,
                tag=aws.autoscaling.TagTagArgs(key=key, value=value, propagate_at_launch=False),
                opts=pulumi.ResourceOptions(parent=node_group),
            )
        return node_group


def _slug(tag_key: str) -> str:
    """A stable resource name for one ASG tag (keys are unique per group)."""
    short = tag_key.removeprefix("k8s.io/cluster-autoscaler/").removeprefix("node-template/")
    return short.replace("/", "-").replace(".", "-")
