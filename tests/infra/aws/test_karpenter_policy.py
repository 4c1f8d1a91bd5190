"""The Karpenter controller's IAM policy, statement by statement against upstream's own.

Upstream's policy is read from Karpenter v1.9.0's getting-started CloudFormation template as
published (shared/schemas/karpenter-v1.9.0/cloudformation.yaml), not from a list of ours: the
template is parsed with its CloudFormation tags (`!Sub`, `!GetAtt`, `!Ref`), the policy's `!Sub`
variables are filled in as CloudFormation would for this stack, and the result is compared
with what the Pulumi program declares for tests/stacks/Pulumi.karpenter.yaml.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from infra.aws.iam import KARPENTER_OMITTED_STATEMENTS
from infra.spec.stack_file import load_stack
from tests.support.pulumi_program import KARPENTER_STACK, MOCK_ACCOUNT, ProgramRun, example_run, mock_arn
from tests.support.stacks import KARPENTER_SCHEMAS

CLUSTER, REGION = "llmstack-karpenter", load_stack(KARPENTER_STACK).cloud.region


class CloudFormationLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short-form intrinsic functions, kept as {"Fn::...": value}."""


def _intrinsic(name: str):
    def construct(loader: yaml.Loader, node: yaml.Node) -> dict[str, Any]:
        if isinstance(node, yaml.ScalarNode):
            value: Any = loader.construct_scalar(node)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            value = loader.construct_mapping(node, deep=True)
        return {name: value}

    return construct


for _tag, _name in (("!Sub", "Fn::Sub"), ("!GetAtt", "Fn::GetAtt"), ("!Ref", "Ref")):
    CloudFormationLoader.add_constructor(_tag, _intrinsic(_name))


def substitute(template: str, variables: dict[str, str]) -> str:
    """`Fn::Sub`: every `${Name}` replaced; a name the template uses but we did not give fails."""

    def replace(match: re.Match[str]) -> str:
        return variables[match.group(1)]

    return re.sub(r"\$\{([^}!]+)\}", replace, template)


def upstream_statements() -> dict[str, dict[str, Any]]:
    template = yaml.load((KARPENTER_SCHEMAS / "cloudformation.yaml").read_text(), Loader=CloudFormationLoader)
    document = template["Resources"]["KarpenterControllerPolicy"]["Properties"]["PolicyDocument"]["Fn::Sub"]
    filled = substitute(
        document,
        {
            "AWS::Partition": "aws",
            "AWS::Region": REGION,
            "AWS::AccountId": MOCK_ACCOUNT,
            "ClusterName": CLUSTER,
            # The two resources of the template the policy points at, as this stack's equivalents.
            "KarpenterInterruptionQueue.Arn": mock_arn("karpenter-interruptions"),
            "KarpenterNodeRole.Arn": mock_arn("karpenter-nodes"),
        },
    )
    return {s["Sid"]: s for s in json.loads(filled)["Statement"]}


def normalized(statement: dict[str, Any]) -> dict[str, Any]:
    """IAM treats a one-element list and a string alike, and list order does not matter."""

    def norm(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        if isinstance(value, list):
            return sorted(norm(v) for v in value) if len(value) != 1 else norm(value[0])
        return value

    return norm(statement)


@pytest.fixture(scope="module")
def ours() -> dict[str, dict[str, Any]]:
    run: ProgramRun = example_run("karpenter")
    [policy] = [r for r in run.of_type("aws:iam/rolePolicy:RolePolicy") if r.name == "karpenter-controller"]
    return {s["Sid"]: s for s in json.loads(policy.inputs["policy"])["Statement"]}


def test_upstreams_template_is_read_whole() -> None:
    upstream = upstream_statements()
    assert len(upstream) == 17
    assert upstream["AllowUnscopedInstanceProfileListAction"]["Action"] == "iam:ListInstanceProfiles"
    assert (
        upstream["AllowAPIServerEndpointDiscovery"]["Resource"]
        == f"arn:aws:eks:{REGION}:{MOCK_ACCOUNT}:cluster/{CLUSTER}"
    )


def test_every_upstream_statement_is_ours_or_left_out_with_a_reason(ours) -> None:
    upstream = upstream_statements()
    assert set(KARPENTER_OMITTED_STATEMENTS) <= set(upstream), "a left-out statement upstream no longer has"
    assert all(KARPENTER_OMITTED_STATEMENTS.values())
    kept = {sid: s for sid, s in upstream.items() if sid not in KARPENTER_OMITTED_STATEMENTS}
    assert set(ours) == set(kept), {"missing": set(kept) - set(ours), "extra": set(ours) - set(kept)}
    for sid, statement in kept.items():
        assert normalized(ours[sid]) == normalized(statement), sid


def test_the_instance_profile_list_the_garbage_collector_calls_is_allowed(ours) -> None:
    assert normalized(ours["AllowUnscopedInstanceProfileListAction"]) == {
        "Sid": "AllowUnscopedInstanceProfileListAction",
        "Effect": "Allow",
        "Resource": "*",
        "Action": "iam:ListInstanceProfiles",
    }


def test_left_out_statements_grant_nothing_we_need(ours) -> None:
    """What the left-out statements allow is instance-profile management, which never happens here:
    every EC2NodeClass names the profile the program made, none names a role."""
    upstream = upstream_statements()
    left_out = {a for sid in KARPENTER_OMITTED_STATEMENTS for a in [upstream[sid]["Action"]][0]}
    assert left_out == {
        "iam:CreateInstanceProfile",
        "iam:TagInstanceProfile",
        "iam:AddRoleToInstanceProfile",
        "iam:RemoveRoleFromInstanceProfile",
        "iam:DeleteInstanceProfile",
    }
    granted = {a for s in ours.values() for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
    assert not left_out & granted
    run = example_run("karpenter")
    classes = run.of_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass")
    assert classes and all("instanceProfile" in c.inputs["spec"] and "role" not in c.inputs["spec"] for c in classes)
