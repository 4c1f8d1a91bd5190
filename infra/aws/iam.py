"""IAM shared by the components: trust policies, IRSA roles, and the controller policies.

Least privilege, stated as rules the policy tests check:
- no wildcard actions (`*`, `service:*`); every action is named;
- `"Resource": "*"` only for read-only actions (Describe/Get/List), or with a condition that
  scopes it to this cluster's tagged resources or this stack's VPC.

The two controller policies are written for what llmstack runs: the Cluster Autoscaler on
managed node groups, and the AWS Load Balancer Controller for one NLB `Service` (no ALB
Ingress, WAF or Shield, so none of those permissions).
"""

from __future__ import annotations

import json
from typing import Any

import pulumi
import pulumi_aws as aws

CLUSTER_TAG = "elbv2.k8s.aws/cluster"  # the LB controller tags what it creates with the cluster name


def assume_role_policy(service: str) -> str:
    """Trust policy letting an AWS service (eks.amazonaws.com, ec2.amazonaws.com) assume a role."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}],
        }
    )


def irsa_role(
    name: str,
    *,
    oidc_provider_arn: pulumi.Input[str],
    oidc_issuer: pulumi.Input[str],
    namespace: str,
    service_account: str,
    policy: pulumi.Input[str] | None = None,
    managed_policy_arn: str | None = None,
    opts: pulumi.ResourceOptions,
) -> aws.iam.Role:
    """A role only one Kubernetes service account can assume (IAM Roles for Service Accounts).

    `oidc_issuer` is the issuer URL without `https://`, as IAM condition keys spell it.
    """
    trust = pulumi.Output.all(oidc_provider_arn, oidc_issuer).apply(
        lambda a: json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [
                    {
                        "Effect": "Allow",
                        "Principal": {"Federated": a[0]},
                        "Action": "sts:AssumeRoleWithWebIdentity",
                        "Condition": {
                            "StringEquals": {
                                f"{a[1]}:sub": f"system:serviceaccount:{namespace}:{service_account}",
                                f"{a[1]}:aud": "sts.amazonaws.com",
                            }
                        },
                    }
                ],
            }
        )
    )
    role = aws.iam.Role(name, assume_role_policy=trust, opts=opts)
    child = pulumi.ResourceOptions.merge(opts, pulumi.ResourceOptions(parent=role))
    if policy is not None:
        aws.iam.RolePolicy(name, role=role.id, policy=policy, opts=child)
    if managed_policy_arn is not None:
        aws.iam.RolePolicyAttachment(name, role=role.name, policy_arn=managed_policy_arn, opts=child)
    return role


def _statement(
    sid: str, actions: list[str], resource: str | list[str] = "*", condition: dict[str, Any] | None = None
) -> dict[str, Any]:
    statement: dict[str, Any] = {"Sid": sid, "Effect": "Allow", "Action": actions, "Resource": resource}
    if condition:
        statement["Condition"] = condition
    return statement


def cluster_autoscaler_policy(cluster_name: str) -> str:
    """Describe anything (the autoscaler must see every group to pick one); scale and terminate
    only groups tagged as owned by this cluster, which EKS and `managed_node_groups.py` tag."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                _statement(
                    "Describe",
                    [
                        "autoscaling:DescribeAutoScalingGroups",
                        "autoscaling:DescribeAutoScalingInstances",
                        "autoscaling:DescribeLaunchConfigurations",
                        "autoscaling:DescribeScalingActivities",
                        "autoscaling:DescribeTags",
                        "ec2:DescribeImages",
                        "ec2:DescribeInstanceTypes",
                        "ec2:DescribeLaunchTemplateVersions",
                        "ec2:GetInstanceTypesFromInstanceRequirements",
                        "eks:DescribeNodegroup",
                    ],
                ),
                _statement(
                    "ScaleOwnedGroups",
                    ["autoscaling:SetDesiredCapacity", "autoscaling:TerminateInstanceInAutoScalingGroup"],
                    condition={"StringEquals": {f"aws:ResourceTag/k8s.io/cluster-autoscaler/{cluster_name}": "owned"}},
                ),
            ],
        }
    )


def load_balancer_controller_policy(cluster_name: str, vpc_id: pulumi.Input[str]) -> pulumi.Output[str]:
    """What the AWS Load Balancer Controller needs to run one NLB with IP targets.

    It creates a load balancer, target groups and a frontend security group tagged with the
    cluster name, and may change only what carries that tag; it adds rules for NLB traffic
    to the node security group, which is allowed only on security groups in this VPC.
    """
    owned = {"StringEquals": {f"aws:ResourceTag/{CLUSTER_TAG}": cluster_name}}
    creating = {"StringEquals": {f"aws:RequestTag/{CLUSTER_TAG}": cluster_name}}
    nlb = [
        "arn:aws:elasticloadbalancing:*:*:loadbalancer/net/*/*",
        "arn:aws:elasticloadbalancing:*:*:listener/net/*/*/*",
    ]
    tagged_elb = [*nlb, "arn:aws:elasticloadbalancing:*:*:targetgroup/*/*"]

    def document(vpc: str) -> str:
        in_vpc = {"ArnLike": {"ec2:Vpc": f"arn:aws:ec2:*:*:vpc/{vpc}"}}
        return json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [
                    _statement(
                        "Read",
                        [
                            "ec2:DescribeAccountAttributes",
                            "ec2:DescribeAddresses",
                            "ec2:DescribeAvailabilityZones",
                            "ec2:DescribeInternetGateways",
                            "ec2:DescribeVpcs",
                            "ec2:DescribeSubnets",
                            "ec2:DescribeSecurityGroups",
                            "ec2:DescribeInstances",
                            "ec2:DescribeNetworkInterfaces",
                            "ec2:DescribeTags",
                            "ec2:GetSecurityGroupsForVpc",
                            "elasticloadbalancing:DescribeLoadBalancers",
                            "elasticloadbalancing:DescribeLoadBalancerAttributes",
                            "elasticloadbalancing:DescribeListeners",
                            "elasticloadbalancing:DescribeListenerAttributes",
                            "elasticloadbalancing:DescribeListenerCertificates",
                            "elasticloadbalancing:DescribeSSLPolicies",
                            "elasticloadbalancing:DescribeRules",
                            "elasticloadbalancing:DescribeTargetGroups",
                            "elasticloadbalancing:DescribeTargetGroupAttributes",
                            "elasticloadbalancing:DescribeTargetHealth",
                            "elasticloadbalancing:DescribeTags",
                            "elasticloadbalancing:DescribeCapacityReservation",
                            "acm:ListCertificates",
                            "acm:DescribeCertificate",
                        ],
                    ),
                    _statement(
                        "ServiceLinkedRole",
                        ["iam:CreateServiceLinkedRole"],
                        condition={"StringEquals": {"iam:AWSServiceName": "elasticloadbalancing.amazonaws.com"}},
                    ),
                    _statement("SecurityGroupInVpc", ["ec2:CreateSecurityGroup"], f"arn:aws:ec2:*:*:vpc/{vpc}"),
                    _statement(
                        "CreateTaggedSecurityGroup",
                        ["ec2:CreateSecurityGroup"],
                        "arn:aws:ec2:*:*:security-group/*",
                        creating,
                    ),
                    _statement(
                        "TagOnCreate",
                        ["ec2:CreateTags"],
                        "arn:aws:ec2:*:*:security-group/*",
                        {"StringEquals": {"ec2:CreateAction": "CreateSecurityGroup"}},
                    ),
                    _statement(
                        "OwnedSecurityGroups",
                        [
                            "ec2:AuthorizeSecurityGroupIngress",
                            "ec2:RevokeSecurityGroupIngress",
                            "ec2:DeleteSecurityGroup",
                            "ec2:CreateTags",
                            "ec2:DeleteTags",
                        ],
                        "arn:aws:ec2:*:*:security-group/*",
                        owned,
                    ),
                    _statement(
                        "NodeSecurityGroupRules",
                        ["ec2:AuthorizeSecurityGroupIngress", "ec2:RevokeSecurityGroupIngress"],
                        "arn:aws:ec2:*:*:security-group/*",
                        in_vpc,
                    ),
                    _statement(
                        "CreateTaggedLoadBalancing",
                        ["elasticloadbalancing:CreateLoadBalancer", "elasticloadbalancing:CreateTargetGroup"],
                        "*",
                        creating,
                    ),
                    _statement(
                        "TagLoadBalancingOnCreate",
                        ["elasticloadbalancing:AddTags"],
                        tagged_elb,
                        {
                            "StringEquals": {
                                "elasticloadbalancing:CreateAction": [
                                    "CreateLoadBalancer",
                                    "CreateTargetGroup",
                                    "CreateListener",
                                ]
                            }
                        },
                    ),
                    _statement(
                        "Listeners",
                        [
                            "elasticloadbalancing:CreateListener",
                            "elasticloadbalancing:DeleteListener",
                            "elasticloadbalancing:ModifyListener",
                            "elasticloadbalancing:ModifyListenerAttributes",
                            "elasticloadbalancing:AddListenerCertificates",
                            "elasticloadbalancing:RemoveListenerCertificates",
                        ],
                        nlb,
                    ),
                    _statement(
                        "OwnedLoadBalancing",
                        [
                            "elasticloadbalancing:ModifyLoadBalancerAttributes",
                            "elasticloadbalancing:SetIpAddressType",
                            "elasticloadbalancing:SetSecurityGroups",
                            "elasticloadbalancing:SetSubnets",
                            "elasticloadbalancing:DeleteLoadBalancer",
                            "elasticloadbalancing:ModifyTargetGroup",
                            "elasticloadbalancing:ModifyTargetGroupAttributes",
                            "elasticloadbalancing:RegisterTargets",
                            "elasticloadbalancing:DeregisterTargets",
                            "elasticloadbalancing:DeleteTargetGroup",
                            "elasticloadbalancing:AddTags",
                            "elasticloadbalancing:RemoveTags",
                        ],
                        "*",
                        owned,
                    ),
                ],
            }
        )

    return pulumi.Output.from_input(vpc_id).apply(document)


# Statements of upstream's controller policy that llmstack leaves out, and why. Every other
# statement is upstream's, Sid for Sid (tests/infra/aws/test_karpenter_policy.py compares them with
# upstream's own cloudformation.yaml).
KARPENTER_OMITTED_STATEMENTS = {
    sid: "the EC2NodeClasses name an instance profile this program creates (spec.instanceProfile), so "
    "Karpenter never creates, tags or deletes one"
    for sid in (
        "AllowScopedInstanceProfileCreationActions",
        "AllowScopedInstanceProfileTagActions",
        "AllowScopedInstanceProfileActions",
    )
}


def karpenter_controller_policy(
    cluster_name: str,
    region: str,
    account_id: pulumi.Input[str],
    node_role_arn: pulumi.Input[str],
    queue_arn: pulumi.Input[str],
) -> pulumi.Output[str]:
    """What the Karpenter controller needs, scoped to this cluster's tagged instances.

    Upstream's reference controller policy (aws/karpenter-provider-aws v1.9.0,
    website/content/en/docs/getting-started/getting-started-with-karpenter/cloudformation.yaml,
    `KarpenterControllerPolicy`), statement for statement and with its Sids, minus
    `KARPENTER_OMITTED_STATEMENTS`. It keeps `iam:ListInstanceProfiles` and
    `iam:GetInstanceProfile`: the node-class garbage collector lists instance profiles every
    cycle whether or not Karpenter created any. Partition `aws` (no China or GovCloud regions).
    """
    owned = {
        "StringEquals": {f"aws:ResourceTag/kubernetes.io/cluster/{cluster_name}": "owned"},
        "StringLike": {"aws:ResourceTag/karpenter.sh/nodepool": "*"},
    }
    requested = {
        f"aws:RequestTag/kubernetes.io/cluster/{cluster_name}": "owned",
        "aws:RequestTag/eks:eks-cluster-name": cluster_name,
    }
    nodepool_requested = {"StringLike": {"aws:RequestTag/karpenter.sh/nodepool": "*"}}
    ec2 = f"arn:aws:ec2:{region}"
    created = [
        f"{ec2}:*:{kind}/*"
        for kind in ("fleet", "instance", "volume", "network-interface", "launch-template", "spot-instances-request")
    ]

    def document(args: list[str]) -> str:
        account, role_arn, queue = args
        return json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [
                    _statement(
                        "AllowScopedEC2InstanceAccessActions",
                        ["ec2:RunInstances", "ec2:CreateFleet"],
                        [
                            f"{ec2}::image/*",
                            f"{ec2}::snapshot/*",
                            f"{ec2}:*:security-group/*",
                            f"{ec2}:*:subnet/*",
                            f"{ec2}:*:capacity-reservation/*",
                        ],
                    ),
                    _statement(
                        "AllowScopedEC2LaunchTemplateAccessActions",
                        ["ec2:RunInstances", "ec2:CreateFleet"],
                        f"{ec2}:*:launch-template/*",
                        owned,
                    ),
                    _statement(
                        "AllowScopedEC2InstanceActionsWithTags",
                        ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"],
                        [*created, f"{ec2}:*:capacity-reservation/*"],
                        {"StringEquals": requested, **nodepool_requested},
                    ),
                    _statement(
                        "AllowScopedResourceCreationTagging",
                        ["ec2:CreateTags"],
                        created,
                        {
                            "StringEquals": {
                                **requested,
                                "ec2:CreateAction": ["RunInstances", "CreateFleet", "CreateLaunchTemplate"],
                            },
                            **nodepool_requested,
                        },
                    ),
                    _statement(
                        "AllowScopedResourceTagging",
                        ["ec2:CreateTags"],
                        f"{ec2}:*:instance/*",
                        {
                            **owned,
                            "StringEqualsIfExists": {"aws:RequestTag/eks:eks-cluster-name": cluster_name},
                            "ForAllValues:StringEquals": {
                                "aws:TagKeys": ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]
                            },
                        },
                    ),
                    _statement(
                        "AllowScopedDeletion",
                        ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
                        [f"{ec2}:*:instance/*", f"{ec2}:*:launch-template/*"],
                        owned,
                    ),
                    _statement(
                        "AllowRegionalReadActions",
                        [
                            "ec2:DescribeCapacityReservations",
                            "ec2:DescribeImages",
                            "ec2:DescribeInstances",
                            "ec2:DescribeInstanceTypeOfferings",
                            "ec2:DescribeInstanceTypes",
                            "ec2:DescribeLaunchTemplates",
                            "ec2:DescribeSecurityGroups",
                            "ec2:DescribeSpotPriceHistory",
                            "ec2:DescribeSubnets",
                        ],
                        condition={"StringEquals": {"aws:RequestedRegion": region}},
                    ),
                    _statement(
                        "AllowSSMReadActions", ["ssm:GetParameter"], f"arn:aws:ssm:{region}::parameter/aws/service/*"
                    ),
                    _statement("AllowPricingReadActions", ["pricing:GetProducts"]),
                    _statement(
                        "AllowInterruptionQueueActions",
                        ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"],
                        queue,
                    ),
                    _statement(
                        "AllowPassingInstanceRole",
                        ["iam:PassRole"],
                        role_arn,
                        {"StringEquals": {"iam:PassedToService": ["ec2.amazonaws.com", "ec2.amazonaws.com.cn"]}},
                    ),
                    _statement(
                        "AllowInstanceProfileReadActions",
                        ["iam:GetInstanceProfile"],
                        f"arn:aws:iam::{account}:instance-profile/*",
                    ),
                    _statement("AllowUnscopedInstanceProfileListAction", ["iam:ListInstanceProfiles"]),
                    _statement(
                        "AllowAPIServerEndpointDiscovery",
                        ["eks:DescribeCluster"],
                        f"arn:aws:eks:{region}:{account}:cluster/{cluster_name}",
                    ),
                ],
            }
        )

    return pulumi.Output.all(account_id, node_role_arn, queue_arn).apply(document)
