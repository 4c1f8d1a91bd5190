"""The launch template every managed node group uses: IMDSv2 and an encrypted root volume.

Managed node groups default to IMDSv1-capable instances and an unencrypted root volume
unless the account enables EBS encryption by default. A launch template fixes both for
every node we start. The hop limit is 1: a pod on the pod network is one hop further than the
host, so it cannot fetch the node role's credentials (AWS EKS best practices, "Restrict access
to the instance profile"). What needs AWS runs with its own IRSA role (autoscaler, load balancer
controller, EBS CSI, Karpenter, Ray's model cache reader); the VPC CNI runs on the host network,
and the device plugin calls no AWS API.

Managed node groups refuse a launch template that sets an instance type or an IAM instance
profile, and refuse a node group `disk_size` when a template is given, so the disk lives
here and the instance types stay on the node group.
"""

from __future__ import annotations

import pulumi
import pulumi_aws as aws

ROOT_DEVICE = "/dev/xvda"  # the root device of the Amazon Linux 2023 EKS AMIs
IMDS_HOP_LIMIT = 1


def hardened_launch_template(
    name: str, *, disk_size_gib: int, tags: dict[str, str], opts: pulumi.ResourceOptions
) -> aws.ec2.LaunchTemplate:
    return aws.ec2.LaunchTemplate(
        name,
        description=f"llmstack node group {name}: IMDSv2 only, encrypted gp3 root volume",
        metadata_options=aws.ec2.LaunchTemplateMetadataOptionsArgs(
            http_endpoint="enabled", http_tokens="required", http_put_response_hop_limit=IMDS_HOP_LIMIT
        ),
        block_device_mappings=[
            aws.ec2.LaunchTemplateBlockDeviceMappingArgs(
                device_name=ROOT_DEVICE,
                ebs=aws.ec2.LaunchTemplateBlockDeviceMappingEbsArgs(
                    volume_size=disk_size_gib, volume_type="gp3", encrypted="true", delete_on_termination="true"
                ),
            )
        ],
        tag_specifications=[
            aws.ec2.LaunchTemplateTagSpecificationArgs(resource_type=kind, tags=tags) for kind in ("instance", "volume")
        ],
        tags=tags,
        opts=opts,
    )
