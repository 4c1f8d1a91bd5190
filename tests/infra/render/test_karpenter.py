"""Karpenter objects, rendered for tests/stacks/Pulumi.karpenter.yaml (on-demand and spot), validated
against Karpenter v1.9.0's own CRDs (shared/schemas/karpenter-v1.9.0): structural schema with
unknown fields forbidden, then every CEL rule of the schema (cel-python, tests/support/crds.py),
as an API server would admit them. The first tests restate a few of those rules by hand."""

from __future__ import annotations

import copy
import re

import pytest

from infra.render.gpu_node_template import node_labels
from infra.render.karpenter import karpenter_objects
from infra.spec.schema import CapacityType, GpuNodeGroup
from infra.spec.stack_file import load_stack
from tests.support.crds import CrdValidator, crd_schema
from tests.support.stacks import KARPENTER_SCHEMAS, TEST_CLOUD_STACKS

QUANTITY = re.compile(
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DURATION = re.compile(r"^(([0-9]+(s|m|h))+)|(Never)$")
BUDGET_NODES = re.compile(r"^((100|[0-9]{1,2})%|[0-9]+)$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
WELL_KNOWN_REQUIREMENTS = {
    "node.kubernetes.io/instance-type",
    "karpenter.sh/capacity-type",
    "topology.kubernetes.io/zone",
    "kubernetes.io/arch",
}


def restricted(label: str) -> bool:
    """Karpenter's CEL rules on NodePool template labels (the domains it owns)."""
    domain = label.split("/", 1)[0] if "/" in label else ""
    return (
        domain.endswith("kubernetes.io")
        and not domain.endswith(("node.kubernetes.io", "node-restriction.kubernetes.io"))
        or domain.endswith("k8s.io")
        or domain.endswith("karpenter.sh")
        or domain.endswith("karpenter.k8s.aws")
    )


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    spec = load_stack(TEST_CLOUD_STACKS[0])
    return karpenter_objects(
        spec,
        cluster_name="llmstack-karpenter",
        instance_profile="profile",
        subnet_ids=["subnet-a", "subnet-b"],
        security_group_ids=["sg-1"],
    )


def test_objects_use_the_v1_apis(objects) -> None:
    assert {(o["apiVersion"], o["kind"]) for o in objects} == {
        ("karpenter.sh/v1", "NodePool"),
        ("karpenter.k8s.aws/v1", "EC2NodeClass"),
    }
    names = {o["kind"]: set() for o in objects}
    for o in objects:
        names[o["kind"]].add(o["metadata"]["name"])
    assert names["NodePool"] == names["EC2NodeClass"]


def test_nodepools_pass_karpenters_field_rules(objects) -> None:
    groups = {
        f"llmstack-{g.name}": g for g in load_stack(TEST_CLOUD_STACKS[0]).node_groups if isinstance(g, GpuNodeGroup)
    }
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


# --- against Karpenter v1.9.0's own CRDs ---------------------------------------------------

KIND_FILES = {"NodePool": "karpenter.sh_nodepools.yaml", "EC2NodeClass": "karpenter.k8s.aws_ec2nodeclasses.yaml"}


@pytest.fixture(scope="module")
def validators() -> dict[str, CrdValidator]:
    return {kind: CrdValidator(crd_schema(KARPENTER_SCHEMAS / name)) for kind, name in KIND_FILES.items()}


def rendered_objects() -> list[dict]:
    """Every Karpenter object of the test stack, on-demand and spot, as `llmctl render`'s YAML gives them."""
    import yaml

    spec = load_stack(TEST_CLOUD_STACKS[0])
    spot = spec.model_copy(
        update={
            "node_groups": [
                g.model_copy(update={"capacity_type": CapacityType.SPOT}) if isinstance(g, GpuNodeGroup) else g
                for g in spec.node_groups
            ]
        }
    )
    objects = []
    for stack in (spec, spot):
        objects += karpenter_objects(
            stack,
            cluster_name="llmstack-karpenter",
            instance_profile="KarpenterNodes",
            subnet_ids=["subnet-0a1b2c3d", "subnet-4e5f6a7b"],
            security_group_ids=["sg-0123456789abcdef0"],
        )
    return yaml.safe_load(yaml.safe_dump(objects))


@pytest.mark.parametrize("obj", rendered_objects(), ids=lambda o: f"{o['kind']}-{o['metadata']['name']}")
def test_objects_match_karpenters_crd_schema_and_cel_rules(validators, obj) -> None:
    validator = validators[obj["kind"]]
    assert validator.structural_errors(obj) == []
    report = validator.cel(obj)
    assert report.failures == []
    # The rules on the fields we set ran: e.g. the NodePool's label and requirement rules, the
    # EC2NodeClass's selector-term and AMI alias rules.
    expected = {"NodePool": ".spec.template.metadata.labels", "EC2NodeClass": ".spec.amiSelectorTerms[0].alias"}
    assert any(where.startswith(expected[obj["kind"]]) for where in report.evaluated), report.evaluated


def _broken(kind: str, change) -> dict:
    obj = copy.deepcopy(next(o for o in rendered_objects() if o["kind"] == kind))
    change(obj["spec"])
    return obj


@pytest.mark.parametrize(
    ("kind", "change", "rule"),
    [
        (
            "NodePool",
            lambda s: s["template"]["metadata"]["labels"].update({"karpenter.sh/owned": "x"}),
            "karpenter.sh",
        ),  # a label in a domain Karpenter owns
        ("NodePool", lambda s: s["template"]["spec"]["requirements"][0].update(values=[]), "values.size() != 0"),
        ("EC2NodeClass", lambda s: s["amiSelectorTerms"].append({"id": "ami-0123456789abcdef0"}), "alias"),
        ("EC2NodeClass", lambda s: s.update(role="KarpenterNodeRole"), "instanceProfile"),
    ],
)
def test_cel_rules_can_fail(validators, kind, change, rule) -> None:
    report = validators[kind].cel(_broken(kind, change))
    assert report.failures and any(rule in f for f in report.failures), report.failures


@pytest.mark.parametrize(
    ("kind", "change"),
    [
        ("NodePool", lambda s: s["disruption"].update(consolidationPolicy="WhenIdle")),  # not an enum value
        ("NodePool", lambda s: s["template"]["spec"].update(expireAfter="30 days")),  # not a duration
        ("EC2NodeClass", lambda s: s["metadataOptions"].update(httpPutResponseHopLimits=1)),  # misspelled
    ],
)
def test_schema_errors_are_caught(validators, kind, change) -> None:
    assert validators[kind].structural_errors(_broken(kind, change))
