"""`cloud.node_provisioner: karpenter`, through the Pulumi program under mocks, checked the way
the Cluster Autoscaler path is (tests/infra/aws/test_program.py): what is declared, its inputs, and
what waits for what. The stack is tests/stacks/Pulumi.karpenter.yaml."""

from __future__ import annotations

import json

import pytest

from infra.catalog import versions
from infra.catalog.gpu_catalog import load_catalog
from infra.render.gpu_node_template import node_labels
from infra.spec.schema import CapacityType, GpuNodeGroup
from infra.spec.stack_file import load_stack
from tests.support.pulumi_program import KARPENTER_STACK, NODE_SECURITY_GROUP, ProgramRun, example_run, mock_arn

NODEPOOL = "kubernetes:karpenter.sh/v1:NodePool"
NODECLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"


@pytest.fixture(scope="module")
def run() -> ProgramRun:
    return example_run("karpenter")


@pytest.fixture(scope="module")
def groups() -> list[GpuNodeGroup]:
    return [g for g in load_stack(KARPENTER_STACK).node_groups if isinstance(g, GpuNodeGroup)]


def test_karpenter_replaces_node_groups_and_the_cluster_autoscaler(run: ProgramRun) -> None:
    assert [g.inputs["nodeGroupName"] for g in run.of_type("aws:eks/nodeGroup:NodeGroup")] == ["system"]
    assert not run.of_type("aws:autoscaling/tag:Tag")
    charts = {c.name: c.inputs for c in run.of_type("kubernetes:helm.sh/v4:Chart")}
    assert "cluster-autoscaler" not in charts
    assert not [r for r in run.of_type("aws:iam/role:Role") if r.name == "addons-cluster-autoscaler"]
    karpenter = charts["karpenter"]
    repo, name, version = versions.KARPENTER_CHART
    assert (
        (karpenter["chart"], karpenter["version"])
        == (f"{repo}/{name}", version)
        == ("oci://public.ecr.aws/karpenter/karpenter", "1.9.0")
    )
    [queue] = run.of_type("aws:sqs/queue:Queue")
    values = karpenter["values"]
    assert values["settings"] == {
        "clusterName": "llmstack-karpenter",
        "interruptionQueue": queue.name,
        "clusterEndpoint": "https://ABC.gr7.us-east-1.eks.amazonaws.com",
    }
    assert values["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"] == mock_arn("karpenter-controller")
    assert values["nodeSelector"] == {"llmstack.dev/node-group": "system"}


def test_one_nodepool_per_gpu_group_with_the_gpu_class_fallbacks(run: ProgramRun, groups) -> None:
    pools = {p.inputs["metadata"]["name"]: p.inputs["spec"] for p in run.of_type(NODEPOOL)}
    classes = {c.inputs["metadata"]["name"]: c.inputs["spec"] for c in run.of_type(NODECLASS)}
    assert set(pools) == set(classes) == {f"llmstack-{g.name}" for g in groups}
    catalog = load_catalog()
    for group in groups:
        pool = pools[f"llmstack-{group.name}"]
        template = pool["template"]
        # Same labels and taint as a managed node group: the rendered RayService needs no change.
        assert template["metadata"]["labels"] == node_labels(group)
        assert template["spec"]["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
        requirements = {r["key"]: r for r in template["spec"]["requirements"]}
        types = requirements["node.kubernetes.io/instance-type"]["values"]
        own = catalog[group.instance_type]
        assert types[0] == group.instance_type and len(types) > 1  # somewhere to fall back to
        for name in types:
            other = catalog[name]
            assert (other.gpu_class, other.gpus) == (own.gpu_class, own.gpus)
            assert other.vcpus >= own.vcpus and other.memory_gib >= own.memory_gib
        capacity = "spot" if group.capacity_type is CapacityType.SPOT else "on-demand"
        assert requirements["karpenter.sh/capacity-type"]["values"] == [capacity]
        assert requirements["topology.kubernetes.io/zone"]["values"] == ["us-west-2a", "us-west-2b", "us-west-2c"]
        assert pool["limits"] == {"nvidia.com/gpu": str(group.max_size * own.gpus)}
        # Only empty nodes are consolidated: a node running a replica is never drained to save money.
        assert pool["disruption"]["consolidationPolicy"] == "WhenEmpty"
        node_class = classes[template["spec"]["nodeClassRef"]["name"]]
        assert template["spec"]["nodeClassRef"]["kind"] == "EC2NodeClass"
        [volume] = node_class["blockDeviceMappings"]
        assert volume["ebs"] == {
            "volumeSize": f"{group.disk_size_gib}Gi",
            "volumeType": "gp3",
            "encrypted": True,
            "deleteOnTermination": True,
        }


def test_node_classes_use_the_stacks_network_profile_and_imdsv2(run: ProgramRun) -> None:
    [profile] = run.of_type("aws:iam/instanceProfile:InstanceProfile")
    private = sorted(s.id for s in run.of_type("aws:ec2/subnet:Subnet") if "private" in s.name)
    for node_class in run.of_type(NODECLASS):
        spec = node_class.inputs["spec"]
        assert spec["instanceProfile"] == profile.name == "karpenter-nodes"  # the mock names outputs after resources
        assert sorted(t["id"] for t in spec["subnetSelectorTerms"]) == private
        assert spec["securityGroupSelectorTerms"] == [{"id": NODE_SECURITY_GROUP}]
        assert spec["metadataOptions"]["httpPutResponseHopLimit"] == 1
        assert spec["amiSelectorTerms"] == [{"alias": "al2023@latest"}]


def test_karpenter_nodes_may_join_the_cluster(run: ProgramRun) -> None:
    [profile] = run.of_type("aws:iam/instanceProfile:InstanceProfile")
    node_role = run.one("aws:iam/role:Role", "karpenter-nodes")
    assert profile.inputs["role"] == node_role.name
    [entry] = [e for e in run.of_type("aws:eks/accessEntry:AccessEntry") if e.inputs["type"] == "EC2_LINUX"]
    assert entry.inputs["principalArn"] == mock_arn("karpenter-nodes")
    attached = {
        a.inputs["policyArn"].rsplit("/", 1)[-1]
        for a in run.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
        if a.name.startswith("karpenter-nodes-")
    }
    assert attached == {"AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryPullOnly"}


def test_interruption_queue_gets_every_event_karpenter_handles(run: ProgramRun) -> None:
    [queue] = run.of_type("aws:sqs/queue:Queue")
    assert queue.inputs["sqsManagedSseEnabled"] is True
    patterns = {}
    for rule in run.of_type("aws:cloudwatch/eventRule:EventRule"):
        pattern = json.loads(rule.inputs["eventPattern"])
        patterns[(pattern["source"][0], pattern["detail-type"][0])] = rule
    assert set(patterns) == {
        ("aws.health", "AWS Health Event"),
        ("aws.ec2", "EC2 Spot Instance Interruption Warning"),
        ("aws.ec2", "EC2 Instance Rebalance Recommendation"),
        ("aws.ec2", "EC2 Instance State-change Notification"),
    }
    targets = run.of_type("aws:cloudwatch/eventTarget:EventTarget")
    assert {t.inputs["rule"] for t in targets} == {r.name for r in patterns.values()}
    assert all(t.inputs["arn"] == mock_arn(queue.name) for t in targets)
    [policy] = run.of_type("aws:sqs/queuePolicy:QueuePolicy")
    statements = {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}
    assert statements["EventBridgeSends"]["Principal"]["Service"] == ["events.amazonaws.com", "sqs.amazonaws.com"]
    assert statements["DenyHTTP"]["Effect"] == "Deny"


def test_controller_policy_is_scoped_to_this_cluster(run: ProgramRun) -> None:
    policy = json.loads(run.one("aws:iam/rolePolicy:RolePolicy", "karpenter-controller").inputs["policy"])
    statements = {s["Sid"]: s for s in policy["Statement"]}
    assert statements["AllowPassingInstanceRole"]["Resource"] == mock_arn("karpenter-nodes")
    [queue] = run.of_type("aws:sqs/queue:Queue")
    assert statements["AllowInterruptionQueueActions"]["Resource"] == mock_arn(queue.name)
    for sid in ("AllowScopedEC2LaunchTemplateAccessActions", "AllowScopedDeletion", "AllowScopedResourceTagging"):
        assert (
            statements[sid]["Condition"]["StringEquals"]["aws:ResourceTag/kubernetes.io/cluster/llmstack-karpenter"]
            == "owned"
        )
    actions = {a for s in policy["Statement"] for a in s["Action"]}
    # Reads only: the profile the EC2NodeClasses name is the program's (tests/infra/aws/test_karpenter_policy.py).
    assert {a for a in actions if "InstanceProfile" in a} == {"iam:GetInstanceProfile", "iam:ListInstanceProfiles"}


def test_creation_order(run: ProgramRun) -> None:
    charts = {c.name: c for c in run.of_type("kubernetes:helm.sh/v4:Chart")}
    assert run.waits_for(charts["karpenter"], charts["aws-load-balancer-controller"])
    entry = next(e for e in run.of_type("aws:eks/accessEntry:AccessEntry") if e.inputs["type"] == "EC2_LINUX")
    assert run.waits_for(charts["karpenter"], entry)  # nodes it starts can join
    for obj in run.of_type(NODEPOOL) + run.of_type(NODECLASS):
        assert run.waits_for(obj, charts["karpenter"])  # the CRDs come with the chart
    [rayservice] = run.of_type("kubernetes:ray.io/v1:RayService")
    for obj in run.of_type(NODEPOOL):
        assert run.waits_for(rayservice, obj)  # workers have somewhere to go
