"""`llmctl doctor --stack NAME`: will this stack deploy? Asked of this machine and of AWS.

Local checks (no network): the stack's plan, the Pulumi CLI, kubectl, the AWS CLI (the
kubeconfig gets its tokens from `aws eks get-token`). AWS checks (boto3, standard credential
chain, the stack's region): who we are, and that we are not one of the stack's admin
principals; the stack's zones, the GPU quotas against what the plan needs at max replicas,
each GPU instance type in each zone, that the stack's images exist in ECR
(`ecr.describe_images`, in the registry's own region), for Karpenter stacks with spot groups
that the EC2 Spot service-linked role exists (`iam.get_role`), and the AL2023 NVIDIA AMI EKS
recommends for the stack's Kubernetes version (`ssm.get_parameter`) against the image's CUDA.
Then Docker Hub: that the pinned `rayproject/ray-llm` tag the serving image builds on exists.

When a check cannot ask (`--offline`, no network, no credentials, a permission missing), it
is listed by name as `not run`, with why; the rest still run. `make deploy` runs this with
`strict`, so a check that could not run stops the deploy as a failure does. Verdicts come from
`ops.llmctl.doctor.checks`; this module only gathers the facts.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from infra.catalog.images import parse_image
from infra.catalog.versions import CUDA_TAG, RAY_LLM_IMAGE
from infra.plan.cache_layout import bucket_name
from infra.plan.planner import StackPlan, plan_stack
from infra.spec.schema import AwsCloud, GpuNodeGroup, StackSpec
from ops.llmctl.doctor.checks import (
    ADAPTERS_CHECK,
    ADMINS_CHECK,
    BASE_IMAGE_CHECK,
    PULUMI_INSTALL,
    SPOT_ROLE,
    SPOT_ROLE_CHECK,
    Check,
    QuotaNeed,
    Status,
    adapters_check,
    admins_check,
    base_image_check,
    gpu_ami_check,
    gpu_ami_check_name,
    gpu_ami_parameter,
    image_check,
    needs_adapters_check,
    needs_spot_role_check,
    offering_checks,
    plan_check,
    quota_check,
    quota_needs,
    spot_role_check,
    tool_check,
    zones_check,
)

KUBECTL_INSTALL = "https://kubernetes.io/docs/tasks/tools/"
AWS_CLI_INSTALL = "https://docs.aws.amazon.com/cli/latest/userguide/getting-started-install.html"


DOCKER_HUB = "https://hub.docker.com"
DOCKER_HUB_URL_ENV = "LLMCTL_DOCKER_HUB_URL"  # another endpoint (tests, a mirror), like AWS_ENDPOINT_URL


@dataclass
class AwsClients:
    """The boto3 clients doctor uses; tests pass real clients wrapped in botocore's Stubber."""

    sts: Any
    ec2: Any
    service_quotas: Any
    ecr: Callable[[str], Any]
    """Region -> ECR client (an image's registry may sit in another region than the stack)."""
    iam: Any
    ssm: Any
    s3: Any = None
    """Reads the model cache (the stack's LoRA adapters); None: that check is not run."""

    @classmethod
    def for_region(cls, region: str) -> AwsClients:
        from ops.llmctl import aws

        session = aws.session(region)
        return cls(
            sts=aws.client(session, "sts"),
            ec2=aws.client(session, "ec2"),
            service_quotas=aws.client(session, "service-quotas"),
            ecr=lambda registry_region: aws.client(aws.session(registry_region), "ecr"),
            iam=aws.client(session, "iam"),
            ssm=aws.client(session, "ssm"),
            s3=aws.client(session, "s3"),
        )


def docker_hub_tag_exists(reference: str, base_url: str | None = None, timeout_s: float = 15) -> bool:
    """Whether Docker Hub lists `namespace/repository:tag` (its v2 API: GET .../tags/<tag>,
    404 when the tag does not exist). Other HTTP errors and no network raise OSError."""
    base_url = base_url or os.environ.get(DOCKER_HUB_URL_ENV, DOCKER_HUB)
    repository, tag = reference.rsplit(":", 1)
    namespace, name = repository.split("/", 1)
    url = f"{base_url}/v2/namespaces/{namespace}/repositories/{name}/tags/{tag}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.load(response).get("name") == tag
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise


def local_checks(spec: StackSpec, plan: StackPlan, which: Callable[[str], str | None] = shutil.which) -> list[Check]:
    checks = [plan_check(plan)]
    if isinstance(spec.cloud, AwsCloud):
        checks += [
            tool_check("pulumi", which("pulumi"), required=True, why="make deploy runs it", install=PULUMI_INSTALL),
            tool_check("kubectl", which("kubectl"), required=False, why="the runbooks use it", install=KUBECTL_INSTALL),
            tool_check(
                "aws",
                which("aws"),
                required=False,
                why="the kubeconfig gets tokens with `aws eks get-token`",
                install=AWS_CLI_INSTALL,
            ),
        ]
    return checks


def _images(spec: StackSpec) -> dict[str, str]:
    return {f"versions.{field}": getattr(spec.versions, field) for field in ("gateway_image", "serving_image")}


def aws_check_names(spec: StackSpec, plan: StackPlan) -> list[str]:
    """Every check that asks AWS, in the order they run (what `not run` lists when AWS cannot be asked)."""
    assert isinstance(spec.cloud, AwsCloud)
    return [
        "AWS identity",
        ADMINS_CHECK,
        "region and zones",
        *(f"quota {n.quota.code}" for n in quota_needs(spec, plan)),
        *sorted({f"{g.instance_type} offered" for g in spec.node_groups if isinstance(g, GpuNodeGroup)}),
        *(f"image {key}" for key in _images(spec)),
        *([SPOT_ROLE_CHECK] if needs_spot_role_check(spec) else []),
        gpu_ami_check_name(spec.cloud.kubernetes_version),
        *([ADAPTERS_CHECK] if needs_adapters_check(spec) else []),
    ]


def aws_checks(spec: StackSpec, plan: StackPlan, clients: AwsClients) -> list[Check]:
    """Identity first: if it cannot be asked, nothing else can, and each check says so."""
    from botocore.exceptions import BotoCoreError, ClientError

    from ops.llmctl.aws import describe_aws_error, is_unreachable

    assert isinstance(spec.cloud, AwsCloud)
    region, zones = spec.cloud.region, spec.cloud.availability_zones
    needs = quota_needs(spec, plan)
    images = _images(spec)
    later = aws_check_names(spec, plan)[1:]

    try:
        who = clients.sts.get_caller_identity()
    except (BotoCoreError, ClientError) as exc:
        line = describe_aws_error(exc)
        if is_unreachable(exc):
            return [_not_run(name, line) for name in ["AWS identity", *later]]
        return [
            Check(name="AWS identity", status=Status.FAIL, detail=line, fix="fix the credentials and re-run"),
            *(_not_run(name, "needs working AWS credentials") for name in later),
        ]
    checks = [
        Check(name="AWS identity", status=Status.PASS, detail=f"account {who['Account']} as {who['Arn']}"),
        admins_check(spec.name, who["Arn"], spec.cloud.admin_principal_arns),
    ]

    def ask(names: list[str], doing: str, question: Callable[[], list[Check]]) -> list[Check]:
        try:
            return question()
        except (BotoCoreError, ClientError) as exc:
            return [_not_run(name, describe_aws_error(exc, doing=doing)) for name in names]

    checks += ask(
        ["region and zones"],
        f"listing the zones of {region}",
        lambda: [
            zones_check(
                region,
                zones,
                {z["ZoneName"]: z["State"] for z in clients.ec2.describe_availability_zones()["AvailabilityZones"]},
            )
        ],
    )

    def quota_of(need: QuotaNeed) -> list[Check]:
        return [quota_check(need, _quota_value(clients.service_quotas, need), region)]

    def image_of(key: str, reference: str) -> list[Check]:
        return [image_check(key, reference, found=_in_ecr(clients, reference))]

    for need in needs:
        checks += ask([f"quota {need.quota.code}"], f"reading quota {need.quota.code}", partial(quota_of, need))
    types = sorted({g.instance.instance_type for g in spec.node_groups if isinstance(g, GpuNodeGroup)})
    checks += ask(
        [f"{t} offered" for t in types],
        "listing instance type offerings",
        lambda: offering_checks(spec, _offerings(clients.ec2, types, zones)),
    )
    for key, reference in images.items():
        checks += ask([f"image {key}"], f"looking up {reference} in ECR", partial(image_of, key, reference))
    if needs_spot_role_check(spec):
        checks += ask(
            [SPOT_ROLE_CHECK],
            f"looking up the role {SPOT_ROLE}",
            lambda: [spot_role_check(spec, exists=_role_exists(clients.iam, SPOT_ROLE))],
        )
    version = spec.cloud.kubernetes_version
    checks += ask(
        [gpu_ami_check_name(version)],
        "reading the EKS AMI parameter",
        lambda: [gpu_ami_check(version, _parameter(clients.ssm, gpu_ami_parameter(version)), CUDA_TAG)],
    )
    if needs_adapters_check(spec):
        checks.append(_adapters_in_bucket(spec, clients, who["Account"]))
    return checks


def _adapters_in_bucket(spec: StackSpec, clients: AwsClients, account: str) -> Check:
    from ops.llmctl.aws import AwsProblem
    from ops.llmctl.doctor.adapters import bucket_adapter_problems

    bucket = bucket_name(spec, account)
    if clients.s3 is None:
        return _not_run(ADAPTERS_CHECK, "no S3 client")
    try:
        problems = bucket_adapter_problems(clients.s3, spec=spec, bucket=bucket)
    except AwsProblem as exc:
        return _not_run(ADAPTERS_CHECK, str(exc))
    count = sum(len(m.lora.adapters) for m in spec.models if m.lora is not None)
    return adapters_check(bucket, count, problems)


def registry_checks(tag_exists: Callable[[str], bool]) -> list[Check]:
    try:
        return [base_image_check(RAY_LLM_IMAGE, found=tag_exists(RAY_LLM_IMAGE))]
    except (OSError, ValueError) as exc:
        return [
            Check(
                name=BASE_IMAGE_CHECK,
                status=Status.NOT_RUN,
                detail=f"Docker Hub could not be asked about {RAY_LLM_IMAGE} ({exc})",
                fix=f"re-run llmctl doctor where Docker Hub is reachable ({DOCKER_HUB_URL_ENV} names a mirror)",
            )
        ]


def _role_exists(iam: Any, name: str) -> bool:
    try:
        iam.get_role(RoleName=name)
    except iam.exceptions.NoSuchEntityException:
        return False
    return True


def _parameter(ssm: Any, name: str) -> str | None:
    try:
        return ssm.get_parameter(Name=name)["Parameter"]["Value"]
    except ssm.exceptions.ParameterNotFound:
        return None


def _in_ecr(clients: AwsClients, reference: str) -> bool | None:
    """Whether ECR holds the image; None when it is not an ECR image."""
    image = parse_image(reference)
    if image.ecr_account is None or image.ecr_region is None:
        return None
    ecr = clients.ecr(image.ecr_region)
    wanted = {"imageDigest": image.digest} if image.digest else {"imageTag": image.tag}
    try:
        ecr.describe_images(registryId=image.ecr_account, repositoryName=image.repository, imageIds=[wanted])
    except (ecr.exceptions.ImageNotFoundException, ecr.exceptions.RepositoryNotFoundException):
        return False
    return True


def _not_run(name: str, reason: str) -> Check:
    return Check(name=name, status=Status.NOT_RUN, detail=reason, fix="re-run llmctl doctor once AWS can be asked")


def _quota_value(service_quotas: Any, need: QuotaNeed) -> float:
    """The account's applied value; AWS's default when the account never had one applied."""
    try:
        return service_quotas.get_service_quota(ServiceCode="ec2", QuotaCode=need.quota.code)["Quota"]["Value"]
    except service_quotas.exceptions.NoSuchResourceException:
        return service_quotas.get_aws_default_service_quota(ServiceCode="ec2", QuotaCode=need.quota.code)["Quota"][
            "Value"
        ]


def _offerings(ec2: Any, types: list[str], zones: list[str]) -> set[tuple[str, str]]:
    pages = ec2.get_paginator("describe_instance_type_offerings").paginate(
        LocationType="availability-zone",
        Filters=[{"Name": "instance-type", "Values": types}, {"Name": "location", "Values": zones}],
    )
    return {(o["InstanceType"], o["Location"]) for page in pages for o in page["InstanceTypeOfferings"]}


STYLE = {Status.PASS: "green", Status.WARN: "yellow", Status.FAIL: "red", Status.NOT_RUN: "magenta"}


def doctor_table(stack: str, checks: list[Check]):
    from rich.table import Table

    table = Table("check", "status", "found", "fix", title=f"llmctl doctor: stack {stack}")
    for c in checks:
        table.add_row(c.name, f"[{STYLE[c.status]}]{c.status.value}[/]", c.detail, c.fix)
    return table


def run_doctor(
    spec: StackSpec,
    *,
    offline: bool = False,
    clients: AwsClients | None = None,
    which: Callable[[str], str | None] = shutil.which,
    tag_exists: Callable[[str], bool] = docker_hub_tag_exists,
) -> list[Check]:
    plan = plan_stack(spec)
    checks = local_checks(spec, plan, which)
    if not isinstance(spec.cloud, AwsCloud):
        return checks + [
            Check(
                name="AWS checks",
                status=Status.PASS,
                detail=f"stack {spec.name} runs on this machine: nothing in AWS to check",
            )
        ]
    if offline:
        return checks + [_not_run(name, "--offline") for name in [*aws_check_names(spec, plan), BASE_IMAGE_CHECK]]
    try:
        clients = clients or AwsClients.for_region(spec.cloud.region)
    except ImportError:
        return (
            checks
            + [
                _not_run(name, "boto3 is not installed: pip install -e '.[infra]'")
                for name in aws_check_names(spec, plan)
            ]
            + registry_checks(tag_exists)
        )
    return checks + aws_checks(spec, plan, clients) + registry_checks(tag_exists)
