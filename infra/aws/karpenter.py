"""Karpenter, for stacks with `cloud.node_provisioner: karpenter`: GPU nodes without node groups.

What it takes, the way Karpenter's own getting-started CloudFormation sets it up (aws/karpenter-
provider-aws, getting-started-with-karpenter/cloudformation.yaml), minus what we do not need:

- the controller's IRSA role (`iam.karpenter_controller_policy`: upstream's v1.9.0 policy, scoped to
  this cluster's tags, without the instance-profile management we do not use);
- a node role and its instance profile, with an `EC2_LINUX` access entry so Karpenter's nodes
  may join (managed node groups get theirs from EKS; these are not managed node groups);
- the interruption queue: an SQS queue that EventBridge feeds spot interruption warnings,
  rebalance recommendations, instance state changes and AWS Health scheduled changes, so
  Karpenter drains a node before EC2 takes it away;
- the chart (CRDs included), on the system nodes;
- one EC2NodeClass and NodePool per GPU group, from `infra.render.karpenter`, after the chart
  (its CRDs must exist).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.aws.iam import assume_role_policy, irsa_role, karpenter_controller_policy
from infra.catalog.versions import KARPENTER_CHART
from infra.render.common import NODE_GROUP_LABEL
from infra.render.karpenter import karpenter_objects
from infra.spec.schema import StackSpec

NAMESPACE = "kube-system"
SERVICE_ACCOUNT = "karpenter"
MANAGED = "arn:aws:iam::aws:policy/"
NODE_POLICIES = ["AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryPullOnly"]
QUEUE_RETENTION_S = 300  # an interruption notice older than the two-minute warning is useless
# EventBridge patterns Karpenter handles (source, detail-type), as in its CloudFormation.
INTERRUPTION_EVENTS = {
    "scheduled-change": ("aws.health", "AWS Health Event"),
    "spot-interruption": ("aws.ec2", "EC2 Spot Instance Interruption Warning"),
    "rebalance": ("aws.ec2", "EC2 Instance Rebalance Recommendation"),
    "instance-state-change": ("aws.ec2", "EC2 Instance State-change Notification"),
}


def queue_policy(queue_arn: str) -> str:
    """EventBridge (and SQS itself) may send to the queue; nothing may use it without TLS."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Id": "EC2InterruptionPolicy",
            "Statement": [
                {
                    "Sid": "EventBridgeSends",
                    "Effect": "Allow",
                    "Principal": {"Service": ["events.amazonaws.com", "sqs.amazonaws.com"]},
                    "Action": "sqs:SendMessage",
                    "Resource": queue_arn,
                },
                {
                    "Sid": "DenyHTTP",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "sqs:*",
                    "Resource": queue_arn,
                    "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                },
            ],
        }
    )


@dataclass
class KarpenterArgs:
    spec: StackSpec
    cluster_name: str
    cluster_endpoint: pulumi.Input[str]
    region: str
    account_id: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]
    subnet_ids: pulumi.Input[list[str]]
    security_group_id: pulumi.Input[str]
    k8s_provider: k8s.Provider
    after: list[pulumi.Resource]
    """Resources the chart waits for (the load balancer controller: its webhooks)."""


class Karpenter(pulumi.ComponentResource):
    def __init__(self, name: str, args: KarpenterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:Karpenter", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        node_role = aws.iam.Role(
            f"{name}-nodes", assume_role_policy=assume_role_policy("ec2.amazonaws.com"), opts=child
        )
        attachments = [
            aws.iam.RolePolicyAttachment(
                f"{name}-nodes-{p}",
                role=node_role.name,
                policy_arn=MANAGED + p,
                opts=pulumi.ResourceOptions(parent=node_role),
            )
            for p in NODE_POLICIES
        ]
        profile = aws.iam.InstanceProfile(f"{name}-nodes", role=node_role.name, opts=child)
        entry = aws.eks.AccessEntry(
            f"{name}-nodes", cluster_name=args.cluster_name, principal_arn=node_role.arn, type="EC2_LINUX", opts=child
        )

        queue = aws.sqs.Queue(
            f"{name}-interruptions",
            message_retention_seconds=QUEUE_RETENTION_S,
            sqs_managed_sse_enabled=True,
            opts=child,
        )
        aws.sqs.QueuePolicy(
            f"{name}-interruptions",
            queue_url=queue.url,
            policy=queue.arn.apply(queue_policy),
            opts=pulumi.ResourceOptions(parent=queue),
        )
        for event, (source, detail_type) in INTERRUPTION_EVENTS.items():
            rule = aws.cloudwatch.EventRule(
                f"{name}-{event}",
                description=f"Karpenter interruption handling ({args.cluster_name}): {detail_type}",
                event_pattern=json.dumps({"source": [source], "detail-type": [detail_type]}),
                opts=child,
            )
            aws.cloudwatch.EventTarget(
                f"{name}-{event}", rule=rule.name, arn=queue.arn, opts=pulumi.ResourceOptions(parent=rule)
            )

        controller = irsa_role(
            f"{name}-controller",
            oidc_provider_arn=args.oidc_provider_arn,
            oidc_issuer=args.oidc_issuer,
            namespace=NAMESPACE,
            service_account=SERVICE_ACCOUNT,
            opts=child,
            policy=karpenter_controller_policy(
                args.cluster_name, args.region, args.account_id, node_role.arn, queue.arn
            ),
        )

        k8s_opts = pulumi.ResourceOptions(parent=self, provider=args.k8s_provider)
        repo, chart, version = KARPENTER_CHART
        self.chart = k8s.helm.v4.Chart(
            "karpenter",
            chart=f"{repo}/{chart}",
            version=version,
            namespace=NAMESPACE,
            values={
                "settings": {
                    "clusterName": args.cluster_name,
                    "clusterEndpoint": args.cluster_endpoint,
                    "interruptionQueue": queue.name,
                },
                "serviceAccount": {
                    "create": True,
                    "name": SERVICE_ACCOUNT,
                    "annotations": {"eks.amazonaws.com/role-arn": controller.arn},
                },
                "nodeSelector": {NODE_GROUP_LABEL: "system"},
            },
            opts=pulumi.ResourceOptions.merge(k8s_opts, pulumi.ResourceOptions(depends_on=[*args.after, entry])),
        )

        objects = pulumi.Output.all(profile.name, args.subnet_ids, args.security_group_id).apply(
            lambda a: karpenter_objects(
                args.spec,
                cluster_name=args.cluster_name,
                instance_profile=a[0],
                subnet_ids=list(a[1]),
                security_group_ids=[a[2]],
            )
        )
        after_chart = pulumi.ResourceOptions.merge(
            k8s_opts, pulumi.ResourceOptions(depends_on=[self.chart, *attachments])
        )
        self.objects = []
        for index, kind in enumerate(_kinds(args.spec)):
            api_version, kind_name, object_name = kind
            self.objects.append(
                k8s.apiextensions.CustomResource(
                    f"{kind_name.lower()}-{object_name}",
                    api_version=api_version,
                    kind=kind_name,
                    metadata=objects.apply(partial(_member, index, "metadata")),
                    spec=objects.apply(partial(_member, index, "spec")),
                    opts=after_chart,
                )
            )
        self.register_outputs({"interruption_queue": queue.name})


def _kinds(spec: StackSpec) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of each Karpenter object, known before the IDs are."""
    placeholders = karpenter_objects(spec, cluster_name="", instance_profile="", subnet_ids=[], security_group_ids=[])
    return [(o["apiVersion"], o["kind"], o["metadata"]["name"]) for o in placeholders]


def _member(index: int, name: str, objs: list[dict[str, Any]]) -> Any:
    """`name` of the `index`-th rendered object (bound per object, not read from the loop later)."""
    return objs[index][name]
