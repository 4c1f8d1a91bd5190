"""The EKS cluster under Pulumi's mocks: who can reach it, who administers it, how it upgrades,
and that the stack's `aws:` settings configure the program's (explicit) AWS provider."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.aws.program import StackRefused
from tests.support.pulumi_program import ProgramRun, example_run, run_program
from tests.support.stacks import stack_document, write_stack

ADMIN_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"
DEPLOYER = "arn:aws:iam::111122223333:role/deployer"


def cluster_of(run: ProgramRun) -> dict:
    [cluster] = run.of_type("aws:eks/cluster:Cluster")
    return cluster.inputs


def test_admin_principals_get_access_entries_with_the_cluster_admin_policy() -> None:
    run = example_run("karpenter")
    [entry] = [e for e in run.of_type("aws:eks/accessEntry:AccessEntry") if e.inputs["type"] == "STANDARD"]
    assert entry.inputs["principalArn"] == "arn:aws:iam::111122223333:role/platform-admins"
    [association] = run.of_type("aws:eks/accessPolicyAssociation:AccessPolicyAssociation")
    assert association.inputs["principalArn"] == entry.inputs["principalArn"]
    assert association.inputs["policyArn"] == ADMIN_POLICY
    assert association.inputs["accessScope"] == {"type": "cluster"}
    assert run.waits_for(association, entry)  # EKS refuses a policy for a principal without an entry


def test_no_admin_principals_no_entries_beyond_the_creator() -> None:
    run = example_run("dev")
    assert not run.of_type("aws:eks/accessEntry:AccessEntry")
    assert cluster_of(run)["accessConfig"]["bootstrapClusterCreatorAdminPermissions"] is True


@pytest.mark.parametrize(
    ("stack", "cidrs"), [("dev", ["0.0.0.0/0"]), ("karpenter", ["203.0.113.0/24", "198.51.100.0/24"])]
)
def test_api_endpoint_public_cidrs_follow_the_spec(stack: str, cidrs: list[str]) -> None:
    assert cluster_of(example_run(stack))["vpcConfig"]["publicAccessCidrs"] == cidrs


@pytest.mark.parametrize(("stack", "policy"), [("dev", "STANDARD"), ("prod", "STANDARD"), ("karpenter", "EXTENDED")])
def test_upgrade_policy_and_version_come_from_the_spec(stack: str, policy: str) -> None:
    cluster = cluster_of(example_run(stack))
    assert cluster["upgradePolicy"] == {"supportType": policy}
    assert cluster["version"] == "1.35"


def test_upgrade_policy_must_be_explicit(tmp_path: Path) -> None:
    write_stack(
        tmp_path,
        "implicit",
        stack_document(cloud={"provider": "aws", "availability_zones": ["us-east-1a", "us-east-1b"]}),
    )
    with pytest.raises(StackRefused, match=r"llmstack:cloud.upgrade_policy: required key is missing"):
        run_program("implicit", root=tmp_path)


# --- the stack's aws: settings --------------------------------------------------------------


def _with_aws_settings(tmp_path: Path, **settings: str) -> ProgramRun:
    write_stack(tmp_path, "settings", stack_document())
    return run_program("settings", root=tmp_path, config=settings)


def test_aws_settings_reach_the_explicit_provider(tmp_path: Path) -> None:
    run = _with_aws_settings(
        tmp_path,
        **{
            "aws:profile": "ops",
            "aws:assumeRoles": json.dumps([{"roleArn": DEPLOYER, "sessionName": "pulumi"}]),
            "aws:allowedAccountIds": json.dumps(["111122223333"]),
        },
    )
    [provider] = run.of_type("pulumi:providers:aws")
    # Provider inputs travel to the engine JSON-encoded when they are not strings.
    decode = {k: json.loads(v) if isinstance(v, str) and v[:1] in "[{" else v for k, v in provider.inputs.items()}
    assert decode["profile"] == "ops"
    assert decode["assumeRoles"] == [{"roleArn": DEPLOYER, "sessionName": "pulumi"}]
    assert decode["allowedAccountIds"] == ["111122223333"]
    assert decode["region"] == "us-east-1"
    # kubectl (and Pulumi's Kubernetes provider) get tokens as the same identity.
    kubeconfig = json.loads(run.outputs["kubeconfig"])
    user = kubeconfig["users"][0]["user"]["exec"]
    assert user["args"][user["args"].index("--role-arn") + 1] == DEPLOYER
    assert user["env"] == [{"name": "AWS_PROFILE", "value": "ops"}]


def test_an_aws_region_that_contradicts_the_spec_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StackRefused, match=r"aws:region is eu-west-1 but llmstack:cloud.region is us-east-1"):
        _with_aws_settings(tmp_path, **{"aws:region": "eu-west-1"})


# --- the deploying identity among the admins ---------------------------------------------

PLATFORM = "arn:aws:iam::111122223333:role/ops/platform-admins"


def _admins_stack(tmp_path: Path, admins: list[str]) -> Path:
    cloud = {
        "provider": "aws",
        "availability_zones": ["us-east-1a", "us-east-1b"],
        "upgrade_policy": "standard",
        "admin_principal_arns": admins,
    }
    write_stack(tmp_path, "admins", stack_document(cloud=cloud))
    return tmp_path


@pytest.mark.parametrize(
    "caller",
    [
        "arn:aws:sts::111122223333:assumed-role/platform-admins/laptop-session",  # a session of the role (no path)
        PLATFORM,
    ],
)
def test_the_deploying_identity_among_the_admins_is_refused_before_anything_is_declared(tmp_path, caller) -> None:
    """EKS makes the creator admin itself and refuses a second access entry for it: the deploy
    would stop after the cluster exists. Refused naming the file, the key and the fix."""
    root = _admins_stack(tmp_path, ["arn:aws:iam::111122223333:role/someone-else", PLATFORM])
    with pytest.raises(StackRefused) as refused:
        run_program("admins", root=root, caller_arn=caller)
    message = str(refused.value)
    assert message.startswith("Pulumi.admins.yaml: llmstack:cloud.admin_principal_arns[1] (" + PLATFORM + ")")
    assert caller in message and "Remove admin_principal_arns[1]" in message


@pytest.mark.parametrize(
    "caller",
    [
        "arn:aws:sts::444455556666:assumed-role/platform-admins/s",  # same role name, another account
        "arn:aws:sts::111122223333:assumed-role/platform-admins-ci/s",
        "arn:aws:iam::111122223333:user/platform-admins",  # a user, not the role
    ],
)
def test_other_identities_deploy_with_every_admin_as_an_entry(tmp_path, caller) -> None:
    run = run_program("admins", root=_admins_stack(tmp_path, [PLATFORM]), caller_arn=caller)
    entries = [e.inputs["principalArn"] for e in run.of_type("aws:eks/accessEntry:AccessEntry")]
    assert entries == [PLATFORM]
