"""`llmctl doctor`: verdicts (pure) and the real boto3 clients answered by botocore's Stubber.

Stubber validates every request we make and every response we stub against the service's
own API model, so these are the calls and shapes AWS would see and send.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import pytest
from botocore.stub import Stubber

from infra.catalog.versions import RAY_LLM_IMAGE
from infra.plan.planner import plan_stack
from infra.spec.schema import CapacityType
from infra.spec.stack_file import PROJECT_ROOT, load_stack
from ops.harness.processes import free_port
from ops.llmctl.doctor.checks import CREATE_SPOT_ROLE, QUOTAS, Status, exit_code, quota_family, quota_needs
from ops.llmctl.doctor.cli import AwsClients, docker_hub_tag_exists, run_doctor
from tests.support.pulumi_program import KARPENTER_STACK
from tests.support.stacks import stack_document, write_stack

ROOT = PROJECT_ROOT
ACCOUNT = "111122223333"
ON_DEMAND_G, ON_DEMAND_P, SPOT_G = "L-DB2E81BA", "L-417A185B", "L-3819A6DF"
AMI_135 = "GPU AMI (AL2023 NVIDIA, Kubernetes 1.35)"
AMI_PARAMETER = "/aws/service/eks/optimized-ami/1.35/amazon-linux-2023/x86_64/nvidia/recommended/release_version"
UNREACHABLE = "http://127.0.0.1:9"


class DockerHub(BaseHTTPRequestHandler):
    """Docker Hub's tag endpoint (GET /v2/namespaces/<ns>/repositories/<repo>/tags/<tag>): 200 with
    the tag's record for the tags in `published`, 404 otherwise."""

    published: set[str] = set()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        parts = self.path.split("/")
        reference = f"{parts[3]}/{parts[5]}:{parts[7]}" if len(parts) == 8 else ""
        found = reference in self.published
        body = json.dumps(
            {"name": parts[7], "tag_status": "active"} if found else {"message": "httperror 404: tag not found"}
        ).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def hub():
    """A real HTTP server on 127.0.0.1 speaking Docker Hub's tag API; yields its base URL."""
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), DockerHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    DockerHub.published = {RAY_LLM_IMAGE}
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


def everything(name: str) -> str:
    return f"/usr/bin/{name}"


class Aws:
    """Real boto3 clients (region us-east-1) with a Stubber each; `stub_*` queue answers in call order."""

    def __init__(self) -> None:
        session = boto3.session.Session(
            region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
        )
        ecr = session.client("ecr")
        self.regions_asked: list[str] = []

        def ecr_for(region: str):
            self.regions_asked.append(region)
            return ecr

        self.clients = AwsClients(
            sts=session.client("sts"),
            ec2=session.client("ec2"),
            service_quotas=session.client("service-quotas"),
            ecr=ecr_for,
            iam=session.client("iam"),
            ssm=session.client("ssm"),
        )
        self.sts, self.ec2, self.quotas, self.ecr = (
            Stubber(self.clients.sts),
            Stubber(self.clients.ec2),
            Stubber(self.clients.service_quotas),
            Stubber(ecr),
        )
        self.iam, self.ssm = Stubber(self.clients.iam), Stubber(self.clients.ssm)
        self.identity_answered = self.ami_answered = False
        self.hub = UNREACHABLE

    def stub_identity(self, arn: str = f"arn:aws:iam::{ACCOUNT}:user/ops") -> None:
        self.identity_answered = True
        self.sts.add_response("get_caller_identity", {"Account": ACCOUNT, "Arn": arn, "UserId": "AIDAEXAMPLE"})

    def stub_ami(self, release: str | None = "1.35.2-20261119") -> None:
        self.ami_answered = True
        if release is None:
            self.ssm.add_client_error(
                "get_parameter",
                service_error_code="ParameterNotFound",
                http_status_code=400,
                expected_params={"Name": AMI_PARAMETER},
            )
        else:
            self.ssm.add_response(
                "get_parameter",
                {"Parameter": {"Name": AMI_PARAMETER, "Type": "String", "Value": release, "Version": 1}},
                {"Name": AMI_PARAMETER},
            )

    def stub_spot_role(self, *, exists: bool) -> None:
        if exists:
            self.iam.add_response(
                "get_role",
                {
                    "Role": {
                        "Path": "/aws-service-role/spot.amazonaws.com/",
                        "RoleName": "AWSServiceRoleForEC2Spot",
                        "RoleId": "AROAEXAMPLEEXAMPLE01",
                        "Arn": f"arn:aws:iam::{ACCOUNT}:role/aws-service-role/"
                        "spot.amazonaws.com/AWSServiceRoleForEC2Spot",
                        "CreateDate": "2026-01-01T00:00:00Z",
                    }
                },
                {"RoleName": "AWSServiceRoleForEC2Spot"},
            )
        else:
            self.iam.add_client_error(
                "get_role",
                service_error_code="NoSuchEntity",
                http_status_code=404,
                expected_params={"RoleName": "AWSServiceRoleForEC2Spot"},
            )

    def stub_zones(self, zones: list[str]) -> None:
        self.ec2.add_response(
            "describe_availability_zones",
            {"AvailabilityZones": [{"ZoneName": z, "State": "available", "RegionName": "us-east-1"} for z in zones]},
        )

    def stub_quota(self, code: str, value: float) -> None:
        self.quotas.add_response(
            "get_service_quota",
            {"Quota": {"QuotaCode": code, "Value": value, "ServiceCode": "ec2"}},
            {"ServiceCode": "ec2", "QuotaCode": code},
        )

    def stub_image(
        self, repository: str, tag: str, *, found: bool = True, error: str = "ImageNotFoundException"
    ) -> None:
        expected = {"registryId": ACCOUNT, "repositoryName": repository, "imageIds": [{"imageTag": tag}]}
        if found:
            self.ecr.add_response(
                "describe_images",
                {
                    "imageDetails": [
                        {
                            "registryId": ACCOUNT,
                            "repositoryName": repository,
                            "imageDigest": "sha256:" + "0" * 64,
                            "imageTags": [tag],
                        }
                    ]
                },
                expected,
            )
        else:
            self.ecr.add_client_error(
                "describe_images", service_error_code=error, http_status_code=400, expected_params=expected
            )

    def stub_images(self, *, gateway: bool = True, serving: bool = True) -> None:
        self.stub_image("llmstack-gateway", "0.1.0", found=gateway)
        self.stub_image("llmstack-serving", "0.1.0", found=serving)

    def stub_offerings(self, pairs: list[tuple[str, str]]) -> None:
        self.ec2.add_response(
            "describe_instance_type_offerings",
            {
                "InstanceTypeOfferings": [
                    {"InstanceType": t, "LocationType": "availability-zone", "Location": z} for t, z in pairs
                ]
            },
        )

    def run(self, spec):
        if self.identity_answered and not self.ami_answered:
            self.stub_ami()  # every AWS stack asks for its GPU AMI once the identity answered
        stubbers = (self.sts, self.ec2, self.quotas, self.ecr, self.iam, self.ssm)
        with self.sts, self.ec2, self.quotas, self.ecr, self.iam, self.ssm:
            checks = run_doctor(
                spec,
                clients=self.clients,
                which=everything,
                tag_exists=lambda reference: docker_hub_tag_exists(reference, self.hub),
            )
            for stubber in stubbers:
                stubber.assert_no_pending_responses()
        return {c.name: c for c in checks}


def dev_answers(aws: Aws, *, quota: float, zones_offered=("us-east-1a", "us-east-1b")) -> None:
    aws.stub_identity()
    aws.stub_zones(["us-east-1a", "us-east-1b", "us-east-1c"])
    aws.stub_quota(ON_DEMAND_G, quota)
    aws.stub_offerings([("g6.2xlarge", z) for z in zones_offered])
    aws.stub_images()


# --- pure --------------------------------------------------------------------------------


def test_quota_needs_sum_vcpus_at_max_replicas_per_quota():
    prod = load_stack("prod")
    needs = {n.quota.code: n for n in quota_needs(prod, plan_stack(prod))}
    # Worked out from Pulumi.prod.yaml: the 70B model at TP 4 puts 2 replicas on each 8-GPU
    # p4de.24xlarge, so its max of 4 replicas needs 2 nodes x 96 vCPUs; l40s: 6 x g6e.xlarge
    # (4 vCPUs); a10g-spot: 4 x g5.2xlarge (8 vCPUs), counted against the spot quota.
    assert needs[ON_DEMAND_P].vcpus == 192
    assert needs[ON_DEMAND_G].vcpus == 24
    assert needs[SPOT_G].vcpus == 32
    assert set(needs) == {ON_DEMAND_P, ON_DEMAND_G, SPOT_G}


def test_quota_families_follow_the_instance_family():
    assert [quota_family(t) for t in ("g6.xlarge", "g6e.2xlarge", "g5.48xlarge", "p4d.24xlarge", "p5.48xlarge")] == [
        "G",
        "G",
        "G",
        "P",
        "P",
    ]
    assert QUOTAS[("P", CapacityType.SPOT)].code == "L-7212CCBC"


def test_strict_turns_checks_that_could_not_run_into_failures():
    spec = load_stack("dev")
    checks = run_doctor(spec, offline=True, which=everything)
    assert [c.status for c in checks if c.name == "AWS identity"] == [Status.NOT_RUN]
    assert exit_code(checks) == 0 and exit_code(checks, strict=True) == 1


@pytest.mark.parametrize(
    ("stack", "expected"),
    [
        (
            "dev",
            [
                "AWS identity",
                "admin principals",
                "region and zones",
                f"quota {ON_DEMAND_G}",
                "g6.2xlarge offered",
                "image versions.gateway_image",
                "image versions.serving_image",
                AMI_135,
                "image ray-llm base",
            ],
        ),
        (
            KARPENTER_STACK,
            [
                "AWS identity",
                "admin principals",
                "region and zones",
                f"quota {SPOT_G}",
                f"quota {ON_DEMAND_G}",
                "g5.2xlarge offered",
                "g6.xlarge offered",
                "image versions.gateway_image",
                "image versions.serving_image",
                "EC2 Spot service-linked role",
                AMI_135,
                "image ray-llm base",
            ],
        ),
    ],
)
def test_offline_lists_every_check_it_could_not_run_by_name(stack, expected):
    checks = run_doctor(load_stack(stack), offline=True, which=everything)
    not_run = [c for c in checks if c.status is Status.NOT_RUN]
    assert [c.name for c in not_run] == expected
    assert all(c.detail == "--offline" for c in not_run)
    assert [c.name for c in checks if c.status is not Status.NOT_RUN] == ["stack plan", "pulumi", "kubectl", "aws"]


def test_missing_pulumi_fails_and_missing_kubectl_warns():
    checks = {c.name: c for c in run_doctor(load_stack("dev"), offline=True, which=lambda name: None)}
    assert checks["pulumi"].status is Status.FAIL and "pulumi.com" in checks["pulumi"].fix
    assert checks["kubectl"].status is Status.WARN


# --- against the AWS API model -----------------------------------------------------------


def test_enough_quota_passes(hub):
    aws = Aws()
    aws.hub = hub
    dev_answers(aws, quota=64)
    checks = aws.run(load_stack("dev"))
    assert checks["AWS identity"].status is Status.PASS and ACCOUNT in checks["AWS identity"].detail
    assert checks["region and zones"].status is Status.PASS
    assert checks[f"quota {ON_DEMAND_G}"].status is Status.PASS
    assert checks["g6.2xlarge offered"].status is Status.PASS
    assert exit_code(list(checks.values()), strict=True) == 0


def test_too_little_quota_fails_naming_quota_needed_and_available():
    aws = Aws()
    dev_answers(aws, quota=8)
    spec = load_stack("dev")
    needed = 16  # Pulumi.dev.yaml: at most 2 g6.2xlarge nodes (8 vCPUs each) at peak
    check = aws.run(spec)[f"quota {ON_DEMAND_G}"]
    assert check.status is Status.FAIL
    assert "Running On-Demand G and VT instances" in check.detail
    assert f"need {needed} vCPUs" in check.detail and "8 available in us-east-1" in check.detail
    assert ON_DEMAND_G in check.fix and str(needed) in check.fix


def test_quota_never_applied_falls_back_to_the_aws_default():
    aws = Aws()
    aws.stub_identity()
    aws.stub_zones(["us-east-1a", "us-east-1b"])
    aws.quotas.add_client_error("get_service_quota", service_error_code="NoSuchResourceException")
    aws.quotas.add_response(
        "get_aws_default_service_quota",
        {"Quota": {"QuotaCode": ON_DEMAND_G, "Value": 0.0}},
        {"ServiceCode": "ec2", "QuotaCode": ON_DEMAND_G},
    )
    aws.stub_offerings([("g6.2xlarge", "us-east-1a"), ("g6.2xlarge", "us-east-1b")])
    aws.stub_images()
    check = aws.run(load_stack("dev"))[f"quota {ON_DEMAND_G}"]
    assert check.status is Status.FAIL and "0 available" in check.detail


def test_instance_type_missing_in_a_zone_warns_and_in_every_zone_fails():
    aws = Aws()
    dev_answers(aws, quota=64, zones_offered=("us-east-1a",))
    check = aws.run(load_stack("dev"))["g6.2xlarge offered"]
    assert check.status is Status.WARN and "us-east-1b" in check.detail

    aws = Aws()
    dev_answers(aws, quota=64, zones_offered=())
    assert aws.run(load_stack("dev"))["g6.2xlarge offered"].status is Status.FAIL


def test_zone_outside_the_account_fails_with_the_key_to_change(tmp_path):
    aws = Aws()
    aws.stub_identity()
    aws.stub_zones(["us-east-1a", "us-east-1c"])  # this account has no us-east-1b
    aws.stub_quota(ON_DEMAND_G, 64)
    aws.stub_offerings([("g6.xlarge", "us-east-1a")])
    aws.stub_images()
    spec = load_stack(write_stack(tmp_path, "zones", stack_document()))
    check = aws.run(spec)["region and zones"]
    assert check.status is Status.FAIL and "us-east-1b" in check.detail
    assert "llmstack:cloud.availability_zones" in check.fix


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("ExpiredToken", "AWS credentials are expired or invalid (ExpiredToken)"),
        (
            "AccessDenied",
            "access denied (GetCallerIdentity): the identity needs the IAM permission sts:GetCallerIdentity",
        ),
    ],
)
def test_identity_errors_are_one_line_and_stop_the_aws_checks(code, expected):
    aws = Aws()
    aws.sts.add_client_error("get_caller_identity", service_error_code=code, http_status_code=403)
    checks = aws.run(load_stack("dev"))
    identity = checks["AWS identity"]
    assert identity.status is Status.FAIL and identity.detail.startswith(expected) and "\n" not in identity.detail
    assert checks[f"quota {ON_DEMAND_G}"].status is Status.NOT_RUN


def test_a_missing_permission_or_throttling_marks_only_that_check_not_run():
    aws = Aws()
    aws.stub_identity()
    aws.stub_zones(["us-east-1a", "us-east-1b"])
    aws.quotas.add_client_error("get_service_quota", service_error_code="AccessDeniedException")
    aws.ec2.add_client_error(
        "describe_instance_type_offerings", service_error_code="RequestLimitExceeded", http_status_code=503
    )
    aws.stub_image("llmstack-gateway", "0.1.0")
    aws.ecr.add_client_error("describe_images", service_error_code="AccessDeniedException", http_status_code=403)
    checks = aws.run(load_stack("dev"))
    image = checks["image versions.serving_image"]
    assert image.status is Status.NOT_RUN and "ecr:DescribeImages" in image.detail
    quota = checks[f"quota {ON_DEMAND_G}"]
    assert quota.status is Status.NOT_RUN and "servicequotas:GetServiceQuota" in quota.detail
    offered = checks["g6.2xlarge offered"]
    assert offered.status is Status.NOT_RUN and "throttled" in offered.detail
    assert checks["region and zones"].status is Status.PASS


def test_images_missing_from_ecr_fail_naming_the_image_and_the_fix():
    aws = Aws()
    aws.stub_identity()
    aws.stub_zones(["us-east-1a", "us-east-1b"])
    aws.stub_quota(ON_DEMAND_G, 64)
    aws.stub_offerings([("g6.2xlarge", "us-east-1a"), ("g6.2xlarge", "us-east-1b")])
    aws.stub_image("llmstack-gateway", "0.1.0")
    aws.stub_image("llmstack-serving", "0.1.0", found=False, error="RepositoryNotFoundException")
    checks = aws.run(load_stack("dev"))
    assert checks["image versions.gateway_image"].status is Status.PASS
    missing = checks["image versions.serving_image"]
    assert missing.status is Status.FAIL
    assert "111122223333.dkr.ecr.us-east-1.amazonaws.com/llmstack-serving:0.1.0 is not in ECR" in missing.detail
    assert "first-deploy-of-a-new-stack.md" in missing.fix and "llmstack:versions.serving_image" in missing.fix
    assert aws.regions_asked == ["us-east-1", "us-east-1"]  # the registry's region, from its host
    assert exit_code(list(checks.values())) == 1


def test_images_outside_ecr_are_not_checked_but_said(tmp_path):
    aws = Aws()  # no ECR answer queued: an ECR call would fail the Stubber
    aws.stub_identity()
    aws.stub_zones(["us-east-1a", "us-east-1b"])
    aws.stub_quota(ON_DEMAND_G, 64)
    aws.stub_offerings([("g6.2xlarge", "us-east-1a"), ("g6.2xlarge", "us-east-1b")])
    document = stack_document(
        versions={"gateway_image": "ghcr.io/acme/gw:1", "serving_image": "ghcr.io/acme/sv:1"},
        node_groups=[{"name": "l4", "kind": "gpu", "instance_type": "g6.2xlarge", "max_size": 2}],
    )
    document["config"]["llmstack:models"][0]["node_group"] = "l4"
    checks = aws.run(load_stack(write_stack(tmp_path, "ghcr", document)))
    assert checks["image versions.gateway_image"].status is Status.WARN
    assert "not an ECR image" in checks["image versions.gateway_image"].detail


def test_without_network_local_checks_run_and_aws_checks_say_not_run(tmp_path, fake_pulumi):
    """Real clients, nothing listening: what an offline laptop gets."""
    env = {
        "AWS_ENDPOINT_URL": UNREACHABLE,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_MAX_ATTEMPTS": "1",
        "LLMCTL_DOCKER_HUB_URL": UNREACHABLE,
        "PATH": f"{fake_pulumi}:/usr/bin:/bin",
        "HOME": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "doctor", "--stack", "dev"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in result.stderr + result.stdout
    assert "could not run: AWS identity, admin principals, region and zones" in result.stderr
    assert "image ray-llm base" in result.stderr  # Docker Hub, unreachable here too
    assert "stack plan" in result.stdout and result.returncode == 0, result.stdout + result.stderr
    strict = subprocess.run(
        [sys.executable, "-m", "ops.llmctl.main", "doctor", "--stack", "dev", "--strict"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert strict.returncode == 1


def test_make_deploy_runs_doctor_first_and_stops_before_pulumi(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    called = tmp_path / "pulumi-was-called"
    (bin_dir / "pulumi").write_text(f'#!/bin/sh\necho "$@" >> {called}\nexit 0\n')
    (bin_dir / "pulumi").chmod(0o755)
    env = {
        "AWS_ENDPOINT_URL": UNREACHABLE,
        "AWS_ACCESS_KEY_ID": "testing",
        "LLMCTL_DOCKER_HUB_URL": UNREACHABLE,
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_MAX_ATTEMPTS": "1",
        "HOME": str(tmp_path),
        "PATH": f"{bin_dir}:/usr/bin:/bin",
    }
    result = subprocess.run(
        [sys.executable, "-m", "ops.llmctl.deploy", "deploy", "--stack", "dev"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1 and "stopped by llmctl doctor" in result.stderr
    assert "llmctl doctor: stack dev" in result.stdout
    assert not called.exists()


# --- what a new account and a first deploy need ----------------------------------------------

KARPENTER_ZONES = ["us-west-2a", "us-west-2b", "us-west-2c"]


def karpenter_answers(aws: Aws, *, identity: str = f"arn:aws:iam::{ACCOUNT}:user/ops") -> None:
    """Everything tests/stacks/Pulumi.karpenter.yaml asks before the spot role and the AMI."""
    aws.stub_identity(identity)
    aws.stub_zones(KARPENTER_ZONES)
    aws.stub_quota(SPOT_G, 512)
    aws.stub_quota(ON_DEMAND_G, 512)
    aws.stub_offerings([(t, z) for t in ("g5.2xlarge", "g6.xlarge") for z in KARPENTER_ZONES])
    for repository in ("llmstack-gateway", "llmstack-serving"):
        aws.ecr.add_response(
            "describe_images",
            {
                "imageDetails": [
                    {"registryId": ACCOUNT, "repositoryName": repository, "imageDigest": "sha256:" + "0" * 64}
                ]
            },
        )


@pytest.mark.parametrize("exists", [False, True])
def test_karpenter_spot_pools_need_the_ec2_spot_service_linked_role(exists):
    aws = Aws()
    karpenter_answers(aws)
    aws.stub_spot_role(exists=exists)
    check = aws.run(load_stack(KARPENTER_STACK))["EC2 Spot service-linked role"]
    if exists:
        assert check.status is Status.PASS and "l4-spot" in check.detail
    else:
        assert check.status is Status.FAIL and "AWSServiceRoleForEC2Spot does not exist" in check.detail
        assert CREATE_SPOT_ROLE in check.fix and "first-deploy-of-a-new-stack.md" in check.fix


def test_managed_node_groups_do_not_ask_for_the_spot_role(tmp_path):
    """EC2 Auto Scaling creates the role itself at the first spot launch: no IAM call (the Stubber
    would fail one)."""
    document = stack_document(
        node_groups=[
            {"name": "l4", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": 2, "capacity_type": "spot"}
        ]
    )
    aws = Aws()
    aws.stub_identity()
    aws.stub_zones(["us-east-1a", "us-east-1b"])
    aws.stub_quota(SPOT_G, 64)
    aws.stub_offerings([("g6.xlarge", "us-east-1a"), ("g6.xlarge", "us-east-1b")])
    aws.stub_images()
    checks = aws.run(load_stack(write_stack(tmp_path, "cas", document)))
    assert "EC2 Spot service-linked role" not in checks


@pytest.mark.parametrize(
    "identity",
    [
        "arn:aws:sts::111122223333:assumed-role/platform-admins/laptop",
        "arn:aws:iam::111122223333:role/platform-admins",
    ],
)
def test_deploying_as_one_of_the_admin_principals_fails_with_the_key_to_change(identity):
    aws = Aws()
    karpenter_answers(aws, identity=identity)
    aws.stub_spot_role(exists=True)
    check = aws.run(load_stack(KARPENTER_STACK))["admin principals"]
    assert check.status is Status.FAIL
    assert "llmstack:cloud.admin_principal_arns[0] (arn:aws:iam::111122223333:role/platform-admins)" in check.detail
    assert "remove admin_principal_arns[0] from Pulumi.karpenter.yaml" in check.fix


def test_another_identity_passes_the_admin_check():
    aws = Aws()
    karpenter_answers(aws, identity="arn:aws:sts::111122223333:assumed-role/ci-deployer/run-42")
    aws.stub_spot_role(exists=True)
    assert aws.run(load_stack(KARPENTER_STACK))["admin principals"].status is Status.PASS


def test_the_gpu_ami_eks_recommends_is_checked_against_the_images_cuda():
    aws = Aws()
    dev_answers(aws, quota=64)
    aws.stub_ami("1.35.2-20261119")
    check = aws.run(load_stack("dev"))[AMI_135]
    assert check.status is Status.PASS
    assert "1.35.2-20261119" in check.detail and "580" in check.detail and "cu130" in check.detail

    aws = Aws()
    dev_answers(aws, quota=64)
    aws.stub_ami(None)  # no such parameter: EKS has no NVIDIA AMI for this version here
    check = aws.run(load_stack("dev"))[AMI_135]
    assert check.status is Status.FAIL and "kubernetes_version" in check.fix


def test_the_ray_llm_base_image_is_looked_up_on_docker_hub(hub):
    aws = Aws()
    aws.hub = hub
    dev_answers(aws, quota=64)
    check = aws.run(load_stack("dev"))["image ray-llm base"]
    assert check.status is Status.PASS and RAY_LLM_IMAGE in check.detail

    DockerHub.published = set()
    try:
        aws = Aws()
        aws.hub = hub
        dev_answers(aws, quota=64)
        check = aws.run(load_stack("dev"))["image ray-llm base"]
    finally:
        DockerHub.published = {RAY_LLM_IMAGE}
    assert check.status is Status.FAIL and "RAY_LLM_IMAGE in infra/catalog/versions.py" in check.fix

    aws = Aws()  # Docker Hub unreachable: said, not guessed
    dev_answers(aws, quota=64)
    check = aws.run(load_stack("dev"))["image ray-llm base"]
    assert check.status is Status.NOT_RUN and "Docker Hub could not be asked" in check.detail
