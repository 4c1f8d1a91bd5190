"""Security policies, checked over the resource graphs the program declares under mocks.

Each rule is what a policy pack would enforce at `pulumi preview`; here they run as tests
over the dev (in-cluster Redis), prod (ElastiCache, TLS), Karpenter (tests/stacks) and an
external-Redis stack:

- no public Redis: no open CIDR on its security group, private subnets only;
- no unencrypted storage: node root volumes, ElastiCache at rest, the StorageClass;
- no wildcard IAM actions, and `Resource: "*"` only for read-only actions or with a condition;
- no `0.0.0.0/0` ingress anywhere we declare it; the NLB's listener is created by the AWS Load
  Balancer Controller from the gateway Service, the one public entry point;
- exactly one Kubernetes Service of type LoadBalancer: the gateway's.

Helm charts are remote components: under mocks their templates are not rendered, so their
objects are not checked here (their IAM is: it is declared in our code).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from infra.render.common import GATEWAY_NAME
from tests.support.pulumi_program import MOCK_PASSWORD, REDACTED, ProgramRun, example_run, run_program
from tests.support.stacks import stack_document, write_stack

OPEN = {"0.0.0.0/0", "::/0"}
READ_ONLY_VERBS = ("Describe", "Get", "List")


@pytest.fixture(scope="module", params=["dev", "prod", "karpenter", "external"])
def graph(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ProgramRun:
    if request.param != "external":
        return example_run(request.param)
    root: Path = tmp_path_factory.mktemp("stacks")
    write_stack(root, "ext", stack_document(redis={"mode": "external", "host": "redis.internal.example.com"}))
    secrets = {"llmstack:redis_password": "ext-pass", "llmstack:redis_ray_password": "ext-ray-pass"}
    return run_program("ext", root=root, config=secrets, secret_keys=tuple(secrets))


def _private_subnet_ids(run: ProgramRun) -> set[str]:
    return {s.id for s in run.of_type("aws:ec2/subnet:Subnet") if "kubernetes.io/role/internal-elb" in s.inputs["tags"]}


def _public_subnet_ids(run: ProgramRun) -> set[str]:
    return {s.id for s in run.of_type("aws:ec2/subnet:Subnet") if "kubernetes.io/role/elb" in s.inputs["tags"]}


# --- Redis is never public ---------------------------------------------------------------


# What each stack must declare, so that the rules below never pass by looking at nothing.
REDIS_BY_STACK = {"dev": "in_cluster", "prod": "elasticache", "karpenter": "elasticache", "ext": "external"}


def test_each_stack_declares_what_the_policies_look_at(graph: ProgramRun) -> None:
    redis = REDIS_BY_STACK[graph.stack]
    groups = graph.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    [redis_service] = [s for s in graph.of_type("kubernetes:core/v1:Service") if s.name == "llmstack-redis"]
    assert len(groups) == (1 if redis == "elasticache" else 0)
    # In the cluster, Redis is a ClusterIP Service; managed or external, a name for its endpoint.
    assert redis_service.inputs["spec"].get("type", "ClusterIP") == (
        "ClusterIP" if redis == "in_cluster" else "ExternalName"
    )
    if redis == "elasticache":
        [firewall_id] = groups[0].inputs["securityGroupIds"]
        assert graph.by_id(firewall_id).inputs["ingress"], "ElastiCache's security group admits no one"
    assert len(graph.of_type("aws:ec2/defaultSecurityGroup:DefaultSecurityGroup")) == 1
    # The ingress rule types test_no_open_ingress knows; a new kind must be added there first.
    declared = {r.type for r in graph.resources if "ecurityGroup" in r.type and "elasticache" not in r.type}
    assert declared <= {
        "aws:ec2/securityGroup:SecurityGroup",
        "aws:ec2/defaultSecurityGroup:DefaultSecurityGroup",
        "aws:ec2/securityGroupRule:SecurityGroupRule",
        "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
    }, declared


def test_no_public_redis(graph: ProgramRun) -> None:
    for group in graph.of_type("aws:elasticache/replicationGroup:ReplicationGroup"):
        for firewall_id in group.inputs["securityGroupIds"]:
            for rule in graph.by_id(firewall_id).inputs.get("ingress", []):
                assert not set(rule.get("cidrBlocks", []) + rule.get("ipv6CidrBlocks", [])), rule
                assert rule["securityGroups"] and (rule["fromPort"], rule["toPort"]) == (6379, 6379)
        subnet_group = graph.one("aws:elasticache/subnetGroup:SubnetGroup", group.inputs["subnetGroupName"])
        assert set(subnet_group.inputs["subnetIds"]) <= _private_subnet_ids(graph)
    for service in graph.of_type("kubernetes:core/v1:Service"):
        if service.name == "llmstack-redis":
            assert service.inputs["spec"].get("type", "ClusterIP") in ("ClusterIP", "ExternalName")


def test_nodes_and_control_plane_sit_in_private_subnets(graph: ProgramRun) -> None:
    private, public = _private_subnet_ids(graph), _public_subnet_ids(graph)
    assert private and public and not private & public
    for node_group in graph.of_type("aws:eks/nodeGroup:NodeGroup"):
        assert set(node_group.inputs["subnetIds"]) <= private, node_group.name
    [cluster] = graph.of_type("aws:eks/cluster:Cluster")
    assert set(cluster.inputs["vpcConfig"]["subnetIds"]) <= private
    assert all(s.inputs["mapPublicIpOnLaunch"] is False for s in graph.of_type("aws:ec2/subnet:Subnet"))
    [nat] = graph.of_type("aws:ec2/natGateway:NatGateway")
    assert nat.inputs["subnetId"] in public


# --- encryption --------------------------------------------------------------------------


def test_no_unencrypted_storage(graph: ProgramRun) -> None:
    templates = graph.of_type("aws:ec2/launchTemplate:LaunchTemplate")
    assert templates
    for template in templates:
        volumes = template.inputs["blockDeviceMappings"]
        assert volumes and all(v["ebs"]["encrypted"] == "true" for v in volumes), template.name
    for node_group in graph.of_type("aws:eks/nodeGroup:NodeGroup"):
        # A node group without our launch template would get EKS's default, unencrypted unless
        # the account says otherwise; `diskSize` is only allowed without a template.
        assert "launchTemplate" in node_group.inputs and "diskSize" not in node_group.inputs, node_group.name
    for group in graph.of_type("aws:elasticache/replicationGroup:ReplicationGroup"):
        assert group.inputs["atRestEncryptionEnabled"] is True and group.inputs["transitEncryptionEnabled"] is True
    for storage_class in graph.of_type("kubernetes:storage.k8s.io/v1:StorageClass"):
        assert storage_class.inputs["parameters"]["encrypted"] == "true"


def test_nodes_require_imdsv2(graph: ProgramRun) -> None:
    for template in graph.of_type("aws:ec2/launchTemplate:LaunchTemplate"):
        options = template.inputs["metadataOptions"]
        # Hop limit 1: pods (one hop further than the host) cannot take the node role's credentials.
        assert options["httpTokens"] == "required" and options["httpPutResponseHopLimit"] == 1, template.name
    for node_class in graph.of_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"):
        options = node_class.inputs["spec"]["metadataOptions"]
        assert options["httpTokens"] == "required" and options["httpPutResponseHopLimit"] == 1, node_class.name


# --- IAM ---------------------------------------------------------------------------------


def _policy_documents(run: ProgramRun) -> list[tuple[str, dict[str, Any]]]:
    documents = [
        (r.name, json.loads(r.inputs["policy"]))
        for r in run.of_type("aws:iam/rolePolicy:RolePolicy") + run.of_type("aws:iam/policy:Policy")
    ]
    documents += [
        (f"{r.name} (trust)", json.loads(r.inputs["assumeRolePolicy"])) for r in run.of_type("aws:iam/role:Role")
    ]
    return documents


def _as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def test_no_wildcard_iam_actions(graph: ProgramRun) -> None:
    documents = _policy_documents(graph)
    assert any(name in ("addons-cluster-autoscaler", "karpenter-controller") for name, _ in documents)
    for name, document in documents:
        for statement in document["Statement"]:
            assert "NotAction" not in statement and "NotResource" not in statement, name
            assert statement["Effect"] == "Allow", name
            for action in _as_list(statement["Action"]):
                assert "*" not in action, f"{name}: wildcard action {action}"


def test_resource_wildcards_only_for_reads_or_with_conditions(graph: ProgramRun) -> None:
    for name, document in _policy_documents(graph):
        for statement in document["Statement"]:
            if "*" not in _as_list(statement.get("Resource", [])) or "Condition" in statement:
                continue
            writes = [a for a in _as_list(statement["Action"]) if not a.split(":")[1].startswith(READ_ONLY_VERBS)]
            assert not writes, f"{name}: {writes} on every resource without a condition"


def test_irsa_roles_trust_one_service_account_each(graph: ProgramRun) -> None:
    for name, document in _policy_documents(graph):
        for statement in document["Statement"]:
            if statement["Action"] == "sts:AssumeRoleWithWebIdentity":
                subjects = [v for k, v in statement["Condition"]["StringEquals"].items() if k.endswith(":sub")]
                assert len(subjects) == 1 and subjects[0].startswith("system:serviceaccount:"), name
                assert "*" not in subjects[0]


# --- network exposure --------------------------------------------------------------------


def test_no_open_ingress(graph: ProgramRun) -> None:
    for firewall in graph.of_type("aws:ec2/securityGroup:SecurityGroup"):
        for rule in firewall.inputs.get("ingress", []):
            assert not OPEN & set(rule.get("cidrBlocks", []) + rule.get("ipv6CidrBlocks", [])), firewall.name
    for rule in graph.of_type("aws:ec2/securityGroupRule:SecurityGroupRule"):
        if rule.inputs["type"] == "ingress":
            assert not OPEN & set(rule.inputs.get("cidrBlocks", []) + rule.inputs.get("ipv6CidrBlocks", []))
    for rule in graph.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"):
        assert rule.inputs.get("cidrIpv4") not in OPEN and rule.inputs.get("cidrIpv6") not in OPEN
    for default in graph.of_type("aws:ec2/defaultSecurityGroup:DefaultSecurityGroup"):
        assert default.inputs.get("ingress", []) == [] and default.inputs.get("egress", []) == []


def test_kubernetes_api_is_iam_authenticated_and_open_only_to_the_stacks_cidrs(graph: ProgramRun) -> None:
    """The EKS endpoint is public so `pulumi up` can reach it from outside the VPC,
    IAM-authenticated, and reachable only from the stack's `cloud.api_public_cidrs` (open by
    default, which `llmctl plan` warns about). No legacy ConfigMap authentication."""
    [cluster] = graph.of_type("aws:eks/cluster:Cluster")
    assert cluster.inputs["accessConfig"]["authenticationMode"] == "API"
    expected = {"karpenter": ["203.0.113.0/24", "198.51.100.0/24"]}.get(graph.stack, ["0.0.0.0/0"])
    assert cluster.inputs["vpcConfig"]["publicAccessCidrs"] == expected
    assert cluster.inputs["vpcConfig"]["endpointPrivateAccess"] is True
    assert set(cluster.inputs["enabledClusterLogTypes"]) >= {"api", "audit", "authenticator"}


def test_only_the_gateway_is_a_load_balancer(graph: ProgramRun) -> None:
    services = graph.of_type("kubernetes:core/v1:Service")
    exposed = [s for s in services if s.inputs["spec"].get("type") in ("LoadBalancer", "NodePort")]
    assert [s.inputs["metadata"]["name"] for s in exposed] == [GATEWAY_NAME]


def test_every_kubernetes_object_uses_the_one_explicit_provider(graph: ProgramRun) -> None:
    providers = graph.of_type("pulumi:providers:kubernetes")
    assert [p.name for p in providers] == ["k8s"]
    for resource in graph.resources:
        if resource.type.startswith("kubernetes:"):
            assert resource.provider and "pulumi:providers:kubernetes::k8s::" in resource.provider, resource.name


# --- secrets -----------------------------------------------------------------------------


def test_no_secret_in_plain_text(graph: ProgramRun) -> None:
    """Generated and configured passwords appear only inside Pulumi secrets."""
    for resource in graph.resources:
        plain = json.dumps(resource.redacted)
        assert MOCK_PASSWORD not in plain and "ext-pass" not in plain and "ext-ray-pass" not in plain, (
            f"{resource.type} {resource.name}"
        )
    secret = graph.one("kubernetes:core/v1:Secret", "llmstack-redis")
    assert secret.redacted["stringData"] == REDACTED
    assert graph.secret_outputs == {"kubeconfig"}
    plain_outputs = json.dumps({k: v for k, v in graph.outputs.items() if k not in graph.secret_outputs})
    assert MOCK_PASSWORD not in plain_outputs and "ext-pass" not in plain_outputs
