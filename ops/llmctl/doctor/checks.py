"""`llmctl doctor`'s verdicts: pure functions from facts (the plan, AWS answers) to checks.

GPU quotas. EC2 limits running instances per family group in vCPUs, per region, separately
for On-Demand and Spot. The Service Quotas codes (service `ec2`) for the families in
`infra/catalog/gpu_catalog.yaml`:

    L-DB2E81BA  Running On-Demand G and VT instances   g4dn, g5, g6, g6e, vt1 ...
    L-417A185B  Running On-Demand P instances          p3, p4d, p4de, p5 ...
    L-3819A6DF  All G and VT Spot Instance Requests
    L-7212CCBC  All P Spot Instance Requests

A stack needs, per quota, the vCPUs of every node its plan starts at max replicas
(`nodes_at_max` x the instance's vCPUs), summed over the node groups that quota covers.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field

from infra.plan.planner import StackPlan
from infra.spec.schema import CapacityType, GpuNodeGroup, StackSpec

PULUMI_INSTALL = "https://www.pulumi.com/docs/iac/download-install/"


class Status(str, Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    NOT_RUN = "not run"


class Check(BaseModel):
    name: str = Field(description="What was checked.")
    status: Status
    detail: str = Field(description="What was found.")
    fix: str = Field(default="", description="What to do, for warn, fail and not run.")


class Quota(BaseModel):
    code: str
    name: str


QUOTAS: dict[tuple[str, CapacityType], Quota] = {
    ("G", CapacityType.ON_DEMAND): Quota(code="L-DB2E81BA", name="Running On-Demand G and VT instances"),
    ("P", CapacityType.ON_DEMAND): Quota(code="L-417A185B", name="Running On-Demand P instances"),
    ("G", CapacityType.SPOT): Quota(code="L-3819A6DF", name="All G and VT Spot Instance Requests"),
    ("P", CapacityType.SPOT): Quota(code="L-7212CCBC", name="All P Spot Instance Requests"),
}


class QuotaNeed(BaseModel):
    quota: Quota
    vcpus: int = Field(description="vCPUs the plan runs under this quota at max replicas.")
    breakdown: list[str] = Field(description="Per node group: `name: nodes x vCPUs`.")


def quota_family(instance_type: str) -> str:
    """`G` for the G and VT families, `P` for P; EC2's quota groups follow the family letter."""
    family = instance_type.split(".", 1)[0]
    if family.startswith(("g", "vt")):
        return "G"
    if family.startswith("p"):
        return "P"
    raise ValueError(
        f"{instance_type}: no GPU quota known for this family; add it to ops/llmctl/doctor/checks.py QUOTAS"
    )


def quota_needs(spec: StackSpec, plan: StackPlan) -> list[QuotaNeed]:
    nodes_at_max = {g.name: g.nodes_at_max for g in plan.node_groups}
    needs: dict[str, QuotaNeed] = {}
    for group in spec.node_groups:
        if not isinstance(group, GpuNodeGroup) or not nodes_at_max.get(group.name):
            continue
        instance = group.instance
        quota = QUOTAS[(quota_family(instance.instance_type), group.capacity_type)]
        nodes, vcpus = nodes_at_max[group.name], instance.vcpus
        need = needs.setdefault(quota.code, QuotaNeed(quota=quota, vcpus=0, breakdown=[]))
        need.vcpus += nodes * vcpus
        need.breakdown.append(f"{group.name}: {nodes} x {group.instance_type} ({vcpus} vCPUs)")
    return list(needs.values())


def quota_check(need: QuotaNeed, available: float, region: str) -> Check:
    name = f"quota {need.quota.code}"
    found = (
        f"{need.quota.name}: need {need.vcpus} vCPUs at max replicas ({'; '.join(need.breakdown)}), "
        f"{available:g} available in {region}"
    )
    if available >= need.vcpus:
        return Check(name=name, status=Status.PASS, detail=found)
    return Check(
        name=name,
        status=Status.FAIL,
        detail=found,
        fix=f"request {need.vcpus} vCPUs for '{need.quota.name}' ({need.quota.code}) in Service Quotas, "
        f"region {region}, or lower max_replicas; pods would stay Pending",
    )


def offering_checks(spec: StackSpec, offered: set[tuple[str, str]]) -> list[Check]:
    """Each GPU instance type against the stack's zones: missing in some warns, in all fails."""
    zones = list(getattr(spec.cloud, "availability_zones", []))
    checks = []
    for instance_type in sorted({g.instance.instance_type for g in spec.node_groups if isinstance(g, GpuNodeGroup)}):
        missing = [z for z in zones if (instance_type, z) not in offered]
        name = f"{instance_type} offered"
        if not missing:
            checks.append(Check(name=name, status=Status.PASS, detail=f"in every zone: {', '.join(zones)}"))
        elif len(missing) < len(zones):
            checks.append(
                Check(
                    name=name,
                    status=Status.WARN,
                    detail=f"not offered in {', '.join(missing)}",
                    fix=f"nodes start only in {', '.join(z for z in zones if z not in missing)}; to use every zone, "
                    "replace those zones in llmstack:cloud.availability_zones",
                )
            )
        else:
            checks.append(
                Check(
                    name=name,
                    status=Status.FAIL,
                    detail=f"offered in none of {', '.join(zones)}",
                    fix="choose zones that offer it (llmstack:cloud.availability_zones) or another instance type",
                )
            )
    return checks


def zones_check(region: str, zones: list[str], available: dict[str, str]) -> Check:
    """`available`: zone name -> state, as EC2 lists them for the region."""
    bad = [z for z in zones if available.get(z) != "available"]
    if not bad:
        return Check(name="region and zones", status=Status.PASS, detail=f"{region}: {', '.join(zones)} available")
    known = ", ".join(sorted(z for z, s in available.items() if s == "available"))
    return Check(
        name="region and zones",
        status=Status.FAIL,
        detail=f"{region}: {', '.join(bad)} not available",
        fix=f"set llmstack:cloud.availability_zones to zones of {region} (available: {known})",
    )


def plan_check(plan: StackPlan) -> Check:
    if plan.ok:
        return Check(name="stack plan", status=Status.PASS, detail="llmctl plan passes")
    return Check(
        name="stack plan",
        status=Status.FAIL,
        detail="; ".join(f"{p.subject}: {p.message}" for p in plan.problems),
        fix=f"run `llmctl plan --stack {plan.stack}` and change the stack file as it says",
    )


def tool_check(tool: str, path: str | None, *, required: bool, why: str, install: str) -> Check:
    if path:
        return Check(name=tool, status=Status.PASS, detail=path)
    return Check(
        name=tool,
        status=Status.FAIL if required else Status.WARN,
        detail=f"not on PATH ({why})",
        fix=f"install it: {install}",
    )


def exit_code(checks: list[Check], *, strict: bool = False) -> int:
    """1 on any failure; with `strict` (make deploy) a check that could not run counts as one."""
    stops = {Status.FAIL, Status.NOT_RUN} if strict else {Status.FAIL}
    return 1 if any(c.status in stops for c in checks) else 0


def image_check(key: str, reference: str, *, found: bool | None) -> Check:
    """One image of the stack against its registry. `found`: True/False when ECR was asked,
    None when the image is not in ECR (doctor cannot look there)."""
    name = f"image {key}"
    if found is None:
        return Check(
            name=name,
            status=Status.WARN,
            detail=f"{reference}: not an ECR image, not checked",
            fix="make sure the cluster's nodes can pull it (the node role reads ECR only)",
        )
    if found:
        return Check(name=name, status=Status.PASS, detail=f"{reference} is in ECR")
    return Check(
        name=name,
        status=Status.FAIL,
        detail=f"{reference} is not in ECR: pods would stay in ImagePullBackOff",
        fix=f"build and push it (ops/runbooks/first-deploy-of-a-new-stack.md), or fix llmstack:{key}",
    )


# --- what a new account and a first deploy need ---------------------------------------------

SPOT_ROLE = "AWSServiceRoleForEC2Spot"
CREATE_SPOT_ROLE = "aws iam create-service-linked-role --aws-service-name spot.amazonaws.com"
FIRST_DEPLOY_RUNBOOK = "ops/runbooks/first-deploy-of-a-new-stack.md"
SPOT_ROLE_CHECK = "EC2 Spot service-linked role"
ADMINS_CHECK = "admin principals"
BASE_IMAGE_CHECK = "image ray-llm base"


def gpu_ami_check_name(kubernetes_version: str) -> str:
    return f"GPU AMI (AL2023 NVIDIA, Kubernetes {kubernetes_version})"


def gpu_ami_parameter(kubernetes_version: str) -> str:
    """The SSM public parameter naming the AL2023 NVIDIA AMI release EKS recommends for a version."""
    return (
        f"/aws/service/eks/optimized-ami/{kubernetes_version}/amazon-linux-2023/x86_64/nvidia/"
        "recommended/release_version"
    )


def spot_groups(spec: StackSpec) -> list[str]:
    return [g.name for g in spec.node_groups if isinstance(g, GpuNodeGroup) and g.capacity_type is CapacityType.SPOT]


def needs_spot_role_check(spec: StackSpec) -> bool:
    """Only Karpenter needs the role up front: EC2 Auto Scaling, which launches the spot
    instances of managed node groups, creates it itself at the first spot launch (its managed
    policy's `EC2SpotManagement` statement allows iam:CreateServiceLinkedRole for
    spot.amazonaws.com: docs.aws.amazon.com/aws-managed-policy/latest/reference/
    AutoScalingServiceRolePolicy.html). Karpenter calls CreateFleet as its own role, whose
    upstream v1.9.0 policy cannot create the role (Karpenter's getting-started creates it up
    front), and treats `ServiceLinkedRoleCreationNotPermitted` as capacity it cannot get: spot
    pools would never get a node. The role is account-wide and outlives stacks, so it is a
    prerequisite (first-deploy runbook, step 0), not a resource of one stack's program."""
    return getattr(spec.cloud, "node_provisioner", "") == "karpenter" and bool(spot_groups(spec))


def spot_role_check(spec: StackSpec, *, exists: bool) -> Check:
    groups = ", ".join(spot_groups(spec))
    if exists:
        return Check(
            name=SPOT_ROLE_CHECK,
            status=Status.PASS,
            detail=f"{SPOT_ROLE} exists: Karpenter can launch spot nodes for {groups}",
        )
    return Check(
        name=SPOT_ROLE_CHECK,
        status=Status.FAIL,
        detail=f"{SPOT_ROLE} does not exist in this account: Karpenter's spot NodePools ({groups}) would "
        "never get a node (ServiceLinkedRoleCreationNotPermitted)",
        fix=f"create it once per account: `{CREATE_SPOT_ROLE}` ({FIRST_DEPLOY_RUNBOOK})",
    )


def admins_check(stack: str, caller_arn: str, admin_arns: list[str]) -> Check:
    """`pulumi up` refuses the same (infra/spec/principals.py); asked here before anything runs."""
    from infra.spec.principals import deploying_identity_among_admins

    index = deploying_identity_among_admins(caller_arn, admin_arns)
    if index is not None:
        return Check(
            name=ADMINS_CHECK,
            status=Status.FAIL,
            detail=f"llmstack:cloud.admin_principal_arns[{index}] ({admin_arns[index]}) is you "
            f"({caller_arn}): EKS makes the cluster's creator admin already and refuses a "
            "second access entry",
            fix=f"remove admin_principal_arns[{index}] from Pulumi.{stack}.yaml (you stay admin), "
            "or deploy as another identity",
        )
    return Check(
        name=ADMINS_CHECK,
        status=Status.PASS,
        detail=f"you become cluster admin as the creator; {len(admin_arns)} other principal(s) get entries",
    )


def gpu_ami_check(kubernetes_version: str, release: str | None, cuda_tag: str) -> Check:
    """The AMI EKS recommends for the version exists; its driver branch is the one
    infra/catalog/versions.py records from the AMI's build templates, against the image's CUDA."""
    from infra.catalog.versions import CUDA_MIN_DRIVER_MAJOR, EKS_NVIDIA_AMI_DRIVER_MAJOR

    name = gpu_ami_check_name(kubernetes_version)
    if release is None:
        return Check(
            name=name,
            status=Status.FAIL,
            detail=f"EKS publishes no AL2023 NVIDIA AMI for Kubernetes {kubernetes_version} in this region",
            fix="choose a llmstack:cloud.kubernetes_version EKS supports here",
        )
    driver, need = EKS_NVIDIA_AMI_DRIVER_MAJOR.get(kubernetes_version), CUDA_MIN_DRIVER_MAJOR[cuda_tag]
    if driver is None or driver < need:
        return Check(
            name=name,
            status=Status.FAIL,
            detail=f"release {release}: driver branch {driver or 'unknown'}, the image's {cuda_tag} needs {need}+",
            fix="pin the image's cu128 variant for this AMI in infra/catalog/versions.py (CUDA_TAG)",
        )
    return Check(
        name=name,
        status=Status.PASS,
        detail=f"EKS recommends release {release}; driver branch {driver} (amazon-eks-ami templates) runs "
        f"the image's {cuda_tag} (needs {need}+)",
    )


def base_image_check(reference: str, *, found: bool) -> Check:
    if found:
        return Check(name=BASE_IMAGE_CHECK, status=Status.PASS, detail=f"{reference} is published on Docker Hub")
    return Check(
        name=BASE_IMAGE_CHECK,
        status=Status.FAIL,
        detail=f"{reference} is not on Docker Hub: serving.Dockerfile cannot build",
        fix="set RAY_LLM_IMAGE in infra/catalog/versions.py to a published tag of the pinned Ray "
        "(e.g. its -cu128 variant)",
    )


ADAPTERS_CHECK = "LoRA adapters in the model cache"


def needs_adapters_check(spec: StackSpec) -> bool:
    return any(m.lora is not None for m in spec.models)


def adapters_check(bucket: str, adapters: int, problems: list[str]) -> Check:
    """What `ops.llmctl.models.adapters.bucket_adapter_problems` found of the stack's adapters."""
    if not problems:
        return Check(
            name=ADAPTERS_CHECK, status=Status.PASS, detail=f"s3://{bucket}/loras/ holds all {adapters} adapter(s)"
        )
    return Check(
        name=ADAPTERS_CHECK,
        status=Status.FAIL,
        detail=" | ".join(problems),
        fix="upload or fix each adapter named (llmctl models sync --only-adapters); until then a request for "
        "it fails on the replica",
    )
