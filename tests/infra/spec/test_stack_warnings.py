"""Choices a stack may make but should make on purpose, and the plaintext refusal: an AWS
gateway serves TLS unless the stack says `allow_plaintext: true`, and `llmctl plan` warns."""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.spec.stack_file import StackFileError, load_stack, spec_from_document
from infra.spec.stack_warnings import stack_warnings
from ops.llmctl.main import app
from tests.support.stacks import stack_document, write_stack

TODAY = date(2026, 12, 1)
CERT = "arn:aws:acm:us-east-1:111122223333:certificate/00000000-0000-0000-0000-000000000000"


def spec(**overrides):
    return spec_from_document(stack_document(**overrides), name="t", file_label="Pulumi.t.yaml")


def keys(warnings) -> list[str]:
    return [w.key for w in warnings]


def test_an_internet_facing_gateway_without_tls_is_refused() -> None:
    with pytest.raises(StackFileError) as info:
        spec(gateway={})
    assert "llmstack:gateway.certificate_arn: the gateway's load balancer is internet-facing" in str(info.value)
    assert "allow_plaintext: true" in str(info.value)


def test_plaintext_said_out_loud_is_allowed_and_warned() -> None:
    warnings = stack_warnings(spec(gateway={"allow_plaintext": True}), TODAY)
    assert "gateway.allow_plaintext" in keys(warnings)
    assert "gateway.allow_plaintext" not in keys(stack_warnings(spec(gateway={"certificate_arn": CERT}), TODAY))


def test_tls_stacks_render_an_https_listener() -> None:
    from infra.render import render_stack

    service = next(
        o
        for o in render_stack(spec(gateway={"certificate_arn": CERT}))
        if o["kind"] == "Service" and o["metadata"]["name"] == "llmstack-gateway"
    )
    assert service["spec"]["ports"] == [{"name": "https", "port": 443, "targetPort": "http"}]
    assert service["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-ssl-cert"] == CERT


def test_an_open_eks_api_endpoint_warns_and_a_narrowed_one_does_not() -> None:
    assert "cloud.api_public_cidrs" in keys(stack_warnings(spec(), TODAY))
    narrowed = spec(
        cloud={
            "provider": "aws",
            "availability_zones": ["us-east-1a", "us-east-1b"],
            "upgrade_policy": "standard",
            "api_public_cidrs": ["203.0.113.0/24"],
        }
    )
    assert "cloud.api_public_cidrs" not in keys(stack_warnings(narrowed, TODAY))


@pytest.mark.parametrize("bad", [["10.0.0.1/8"], ["not-a-cidr"], []])
def test_api_cidrs_are_validated(bad) -> None:
    with pytest.raises(StackFileError, match=r"llmstack:cloud.api_public_cidrs"):
        spec(
            cloud={
                "provider": "aws",
                "availability_zones": ["us-east-1a", "us-east-1b"],
                "upgrade_policy": "standard",
                "api_public_cidrs": bad,
            }
        )


def test_admin_principals_must_be_role_or_user_arns() -> None:
    with pytest.raises(StackFileError, match=r"assumed-role session ARNs"):
        spec(
            cloud={
                "provider": "aws",
                "availability_zones": ["us-east-1a", "us-east-1b"],
                "upgrade_policy": "standard",
                "admin_principal_arns": ["arn:aws:sts::111122223333:assumed-role/Admin/me"],
            }
        )


@pytest.mark.parametrize(
    ("today", "policy", "warned"),
    [
        (date(2026, 12, 1), "standard", False),  # 116 days before 2027-03-27
        (date(2027, 1, 1), "standard", True),  # within 90 days: EKS will upgrade under our add-ons
        (date(2027, 4, 1), "standard", True),
        (date(2027, 1, 1), "extended", False),  # stays, at extended prices, from 2027-03-27
        (date(2027, 4, 1), "extended", True),
    ],
)
def test_kubernetes_support_calendar(today: date, policy: str, warned: bool) -> None:
    stack = spec(
        cloud={
            "provider": "aws",
            "availability_zones": ["us-east-1a", "us-east-1b"],
            "upgrade_policy": policy,
            "api_public_cidrs": ["203.0.113.0/24"],
        },
        gateway={"certificate_arn": CERT},
    )
    assert bool(stack_warnings(stack, today)) is warned


def test_local_stacks_have_no_cloud_warnings() -> None:
    assert stack_warnings(load_stack("local"), TODAY) == []


def test_llmctl_plan_prints_the_warnings_and_still_passes(tmp_path: Path) -> None:
    path = write_stack(tmp_path, "open", stack_document())
    result = CliRunner().invoke(app, ["plan", "--stack", str(path)])
    assert result.exit_code == 0, result.output
    assert "warning llmstack:gateway.allow_plaintext" in result.output
    assert "warning llmstack:cloud.api_public_cidrs" in result.output
    as_json = json.loads(CliRunner().invoke(app, ["plan", "--stack", str(path), "--json"]).stdout)
    assert {w["key"] for w in as_json["warnings"]} >= {"gateway.allow_plaintext", "cloud.api_public_cidrs"}
