"""Karpenter objects, rendered for tests/stacks/Pulumi.karpenter.yaml and checked against the
rules Karpenter's v1 CRDs enforce on them (karpenter.sh_nodepools.yaml: restricted label
domains, quantity and duration patterns; field names from the v1.9 docs). The CRD files are
not vendored here: what a live API server adds is in the README's "only a real account" list."""

from __future__ import annotations

import re

import pytest

from infra.gpu_nodes import node_labels
from infra.render.karpenter import karpenter_objects
from infra.spec import GpuNodeGroup
from infra.stack_file import load_stack
from tests.support.stacks import TEST_CLOUD_STACKS

QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
                      r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
DURATION = re.compile(r"^(([0-9]+(s|m|h))+)|(Never)$")
BUDGET_NODES = re.compile(r"^((100|[0-9]{1,2})%|[0-9]+)$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
WELL_KNOWN_REQUIREMENTS = {"node.kubernetes.io/instance-type", "karpenter.sh/capacity-type",
                           "topology.kubernetes.io/zone", "kubernetes.io/arch"}


def restricted(label: str) -> bool:
    """Karpenter's CEL rules on NodePool template labels (the domains it owns)."""
    domain = label.split("/", 1)[0] if "/" in label else ""
    return (domain.endswith("kubernetes.io") and not domain.endswith(("node.kubernetes.io",
                                                                     "node-restriction.kubernetes.io"))
            or domain.endswith("k8s.io") or domain.endswith("karpenter.sh") or domain.endswith("karpenter.k8s.aws"))


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    spec = load_stack(TEST_CLOUD_STACKS[0])
    return karpenter_objects(spec, cluster_name="llmstack-karpenter", instance_profile="profile",
                             subnet_ids=["subnet-a", "subnet-b"], security_group_ids=["sg-1"])


def test_objects_use_the_v1_apis(objects) -> None:
    assert {(o["apiVersion"], o["kind"]) for o in objects} == {("karpenter.sh/v1", "NodePool"),
                                                               ("karpenter.k8s.aws/v1", "EC2NodeClass")}
    names = {o["kind"]: set() for o in objects}
    for o in objects:
        names[o["kind"]].add(o["metadata"]["name"])
    assert names["NodePool"] == names["EC2NodeClass"]


def test_nodepools_pass_karpenters_field_rules(objects) -> None:
    groups = {f"llmstack-{g.name}": g for g in load_stack(TEST_CLOUD_STACKS[0]).node_groups
              if isinstance(g, GpuNodeGroup)}
    for pool in (o for o in objects if o["kind"] == "NodePool"):
        spec = pool["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert labels == node_labels(groups[pool["metadata"]["name"]])
        assert not [k for k in labels if restricted(k)], labels
        assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())
        assert {r["key"] for r in spec["template"]["spec"]["requirements"]} == WELL_KNOWN_REQUIREMENTS
        assert all(r["operator"] == "In" and r["values"] for r in spec["template"]["spec"]["requirements"])
        assert all(QUANTITY.match(v) for v in spec["limits"].values())
        assert DURATION.match(spec["template"]["spec"]["expireAfter"])
        disruption = spec["disruption"]
        assert disruption["consolidationPolicy"] in ("WhenEmpty", "WhenEmptyOrUnderutilized")
        assert DURATION.match(disruption["consolidateAfter"])
        assert all(BUDGET_NODES.match(b["nodes"]) for b in disruption["budgets"])


def test_node_classes_name_one_identity_and_select_by_id(objects) -> None:
    for node_class in (o for o in objects if o["kind"] == "EC2NodeClass"):
        spec = node_class["spec"]
        assert "role" not in spec and spec["instanceProfile"] == "profile"  # exactly one of the two
        assert spec["subnetSelectorTerms"] == [{"id": "subnet-a"}, {"id": "subnet-b"}]
        assert spec["securityGroupSelectorTerms"] == [{"id": "sg-1"}]
        assert QUANTITY.match(spec["blockDeviceMappings"][0]["ebs"]["volumeSize"])
