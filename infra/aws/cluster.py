"""The EKS cluster: control plane, IRSA, a small system node group, and its kubeconfig.

Built from `pulumi_aws.eks` resources, not the `pulumi_eks` component. `pulumi_eks.Cluster`
is a remote component: it creates its roles, security groups and aws-auth wiring out of
sight, and under Pulumi's unit-test mocks it creates no children at all, so the policy tests
could not see (or vouch for) any of it. Here every role, policy and setting is a resource in
this file, and the whole control plane is about forty lines.

- Private nodes: the control plane's network interfaces and all nodes sit in the private
  subnets. The API endpoint is public as well as private so `pulumi up` can reach it from a
  laptop; every request to it is authenticated by IAM, and `cloud.api_public_cidrs` narrows
  who may connect at all.
- Authentication mode `API`: access entries, no aws-auth ConfigMap. The identity running
  `pulumi up` gets the cluster-admin entry (`bootstrap_cluster_creator_admin_permissions`), and
  so does each of `cloud.admin_principal_arns` (an entry plus the AmazonEKSClusterAdminPolicy
  association), so the cluster is not lost with the laptop that created it. EKS refuses a
  second entry for the creator, so the program refuses a stack that lists it
  (`infra.spec.principals`) before declaring anything. EKS adds the node role's entry itself when a
  managed node group is created.
- Upgrade policy from the spec: `standard` lets EKS upgrade the control plane when the version
  leaves standard support; `extended` keeps it, at extended-support prices.
- Control-plane logs: api, audit and authenticator go to CloudWatch.
- The system node group (on-demand, untainted) runs the add-ons, the Ray head and the
  gateway. The Ray head asks for 2 CPUs and 8 GiB, more than an m7i.large can give, hence
  m7i.xlarge; two nodes so the gateway spreads over two zones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.aws.iam import assume_role_policy
from infra.aws.launch_template import hardened_launch_template
from infra.render.common import NODE_GROUP_LABEL

CONTROL_PLANE_LOGS = ["api", "audit", "authenticator"]
SYSTEM_GROUP = "system"
SYSTEM_INSTANCE_TYPE = "m7i.xlarge"
SYSTEM_MIN, SYSTEM_DESIRED, SYSTEM_MAX = 2, 2, 4
SYSTEM_DISK_GIB = 50
MANAGED = "arn:aws:iam::aws:policy/"
NODE_POLICIES = ["AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryPullOnly"]
CLUSTER_ADMIN_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"


@dataclass
class ClusterArgs:
    name: str
    kubernetes_version: str
    region: str
    private_subnet_ids: pulumi.Input[list[str]]
    upgrade_policy: str
    """`standard` or `extended` (the spec's cloud.upgrade_policy)."""
    public_access_cidrs: list[str]
    admin_principal_arns: list[str]
    aws_profile: str | None = None
    assume_role_arn: str | None = None
    """The role the stack's `aws:assumeRoles` makes Pulumi act as; the kubeconfig's tokens use it too."""


class Cluster(pulumi.ComponentResource):
    name: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]
    endpoint: pulumi.Output[str]
    oidc_provider_arn: pulumi.Output[str]
    oidc_issuer: pulumi.Output[str]
    node_role_arn: pulumi.Output[str]
    node_security_group_id: pulumi.Output[str]

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("llmstack:aws:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)

        role = aws.iam.Role(
            f"{name}-control-plane", assume_role_policy=assume_role_policy("eks.amazonaws.com"), opts=child
        )
        attached = aws.iam.RolePolicyAttachment(
            f"{name}-control-plane", role=role.name, policy_arn=MANAGED + "AmazonEKSClusterPolicy", opts=child
        )
        cluster = aws.eks.Cluster(
            name,
            name=args.name,
            version=args.kubernetes_version,
            role_arn=role.arn,
            vpc_config=aws.eks.ClusterVpcConfigArgs(
                subnet_ids=args.private_subnet_ids,
                endpoint_private_access=True,
                endpoint_public_access=True,
                public_access_cidrs=args.public_access_cidrs,
            ),
            access_config=aws.eks.ClusterAccessConfigArgs(
                authentication_mode="API", bootstrap_cluster_creator_admin_permissions=True
            ),
            enabled_cluster_log_types=CONTROL_PLANE_LOGS,
            upgrade_policy=aws.eks.ClusterUpgradePolicyArgs(support_type=args.upgrade_policy.upper()),
            opts=pulumi.ResourceOptions(parent=self, depends_on=[attached]),
        )
        self.admin_entries = [self._admin(name, cluster, arn) for arn in args.admin_principal_arns]
        issuer = cluster.identities.apply(lambda ids: ids[0].oidcs[0].issuer)
        oidc = aws.iam.OpenIdConnectProvider(name, url=issuer, client_id_lists=["sts.amazonaws.com"], opts=child)

        node_role = aws.iam.Role(
            f"{name}-nodes", assume_role_policy=assume_role_policy("ec2.amazonaws.com"), opts=child
        )
        self.node_role_policies = [
            aws.iam.RolePolicyAttachment(
                f"{name}-nodes-{p}",
                role=node_role.name,
                policy_arn=MANAGED + p,
                opts=pulumi.ResourceOptions(parent=node_role),
            )
            for p in NODE_POLICIES
        ]
        template = hardened_launch_template(
            f"{name}-{SYSTEM_GROUP}",
            disk_size_gib=SYSTEM_DISK_GIB,
            tags={"Name": f"{args.name}-{SYSTEM_GROUP}"},
            opts=child,
        )
        self.system_nodes = aws.eks.NodeGroup(
            f"{name}-{SYSTEM_GROUP}",
            cluster_name=cluster.name,
            node_group_name=SYSTEM_GROUP,
            node_role_arn=node_role.arn,
            subnet_ids=args.private_subnet_ids,
            instance_types=[SYSTEM_INSTANCE_TYPE],
            ami_type="AL2023_x86_64_STANDARD",
            capacity_type="ON_DEMAND",
            scaling_config=aws.eks.NodeGroupScalingConfigArgs(
                min_size=SYSTEM_MIN, desired_size=SYSTEM_DESIRED, max_size=SYSTEM_MAX
            ),
            update_config=aws.eks.NodeGroupUpdateConfigArgs(max_unavailable=1),
            labels={NODE_GROUP_LABEL: SYSTEM_GROUP},
            launch_template=aws.eks.NodeGroupLaunchTemplateArgs(
                id=template.id, version=template.latest_version.apply(str)
            ),
            # The Cluster Autoscaler owns the node count once the group exists.
            opts=pulumi.ResourceOptions(
                parent=self, depends_on=self.node_role_policies, ignore_changes=["scalingConfig.desiredSize"]
            ),
        )

        self.name = cluster.name
        self.endpoint = cluster.endpoint
        self.oidc_provider_arn = oidc.arn
        self.oidc_issuer = issuer.apply(lambda url: url.removeprefix("https://"))
        self.node_role_arn = node_role.arn
        # Managed node groups without their own security groups use the cluster security group.
        self.node_security_group_id = cluster.vpc_config.apply(lambda v: v.cluster_security_group_id)
        self.kubeconfig = pulumi.Output.secret(
            pulumi.Output.all(
                cluster.name,
                cluster.endpoint,
                cluster.certificate_authority.apply(lambda ca: ca.data),
            ).apply(
                lambda a: kubeconfig(
                    a[0], a[1], a[2], region=args.region, profile=args.aws_profile, role_arn=args.assume_role_arn
                )
            )
        )
        self.register_outputs(
            {"name": self.name, "kubeconfig": self.kubeconfig, "oidc_provider_arn": self.oidc_provider_arn}
        )

    def _admin(self, name: str, cluster: aws.eks.Cluster, principal_arn: str) -> aws.eks.AccessPolicyAssociation:
        slug = principal_arn.rsplit(":", 1)[-1].replace("/", "-")
        entry = aws.eks.AccessEntry(
            f"{name}-admin-{slug}",
            cluster_name=cluster.name,
            principal_arn=principal_arn,
            type="STANDARD",
            opts=pulumi.ResourceOptions(parent=self),
        )
        return aws.eks.AccessPolicyAssociation(
            f"{name}-admin-{slug}",
            cluster_name=cluster.name,
            principal_arn=principal_arn,
            policy_arn=CLUSTER_ADMIN_POLICY,
            access_scope={"type": "cluster"},
            opts=pulumi.ResourceOptions(parent=entry, depends_on=[entry]),
        )


def kubeconfig(
    cluster_name: str, endpoint: str, ca_data: str, *, region: str, profile: str | None, role_arn: str | None = None
) -> str:
    """A kubeconfig that gets a token from `aws eks get-token` (the AWS CLI) on every use, as the
    same identity Pulumi acts as (its profile, and the role the stack assumes)."""
    env = [{"name": "AWS_PROFILE", "value": profile}] if profile else None
    role = ["--role-arn", role_arn] if role_arn else []
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": cluster_name, "cluster": {"server": endpoint, "certificate-authority-data": ca_data}}
            ],
            "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": cluster_name}}],
            "current-context": cluster_name,
            "users": [
                {
                    "name": cluster_name,
                    "user": {
                        "exec": {
                            "apiVersion": "client.authentication.k8s.io/v1beta1",
                            "command": "aws",
                            "args": [
                                "eks",
                                "get-token",
                                "--cluster-name",
                                cluster_name,
                                "--region",
                                region,
                                *role,
                                "--output",
                                "json",
                            ],
                            "env": env,
                            "interactiveMode": "Never",
                        }
                    },
                }
            ],
        }
    )
