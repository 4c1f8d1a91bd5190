"""What a stack allows but an operator should decide on purpose: `llmctl plan` prints these.

Refusals live in the spec (`infra.spec.schema`, a stack that cannot work) and the planner (one that
cannot fit); these are choices that work and cost something: plaintext on the internet, an
EKS API endpoint open to every address, a Kubernetes version about to leave standard support.
Pure: `today` is passed in.
"""

from __future__ import annotations

from datetime import date

from pydantic import BaseModel, Field

from infra.catalog.versions import EKS_STANDARD_SUPPORT_ENDS
from infra.spec.schema import AwsCloud, StackSpec

OPEN_CIDR = "0.0.0.0/0"
SUPPORT_WARNING_DAYS = 90


class StackWarning(BaseModel):
    key: str = Field(description="Key path under `llmstack:` the warning is about.")
    message: str = Field(description="What it means and what to do.")


def stack_warnings(spec: StackSpec, today: date) -> list[StackWarning]:
    if not isinstance(spec.cloud, AwsCloud):
        return []
    cloud, warnings = spec.cloud, []
    if spec.gateway.allow_plaintext and spec.gateway.certificate_arn is None:
        warnings.append(
            StackWarning(
                key="gateway.allow_plaintext",
                message=(
                    "the internet-facing gateway serves plain HTTP: API keys and prompts cross the internet in clear; "
                    "set gateway.certificate_arn to an ACM certificate"
                ),
            )
        )
    if OPEN_CIDR in cloud.api_public_cidrs:
        warnings.append(
            StackWarning(
                key="cloud.api_public_cidrs",
                message=(
                    "the EKS API endpoint accepts connections from any address (requests are still IAM-authenticated); "
                    "list only your office and CI egress ranges"
                ),
            )
        )
    ends = EKS_STANDARD_SUPPORT_ENDS.get(cloud.kubernetes_version)
    if ends is not None:
        days = (ends - today).days
        if cloud.upgrade_policy == "standard" and days <= SUPPORT_WARNING_DAYS:
            when = f"on {ends.isoformat()}" if days >= 0 else f"since {ends.isoformat()}"
            warnings.append(
                StackWarning(
                    key="cloud.kubernetes_version",
                    message=(
                        f"Kubernetes {cloud.kubernetes_version} leaves EKS standard support {when}; with "
                        f"upgrade_policy "
                        "standard EKS then upgrades the control plane under add-ons pinned to this version: "
                        "move to a newer "
                        "version in infra/catalog/versions.py first, or choose upgrade_policy extended (paid)"
                    ),
                )
            )
        elif cloud.upgrade_policy == "extended" and days < 0:
            warnings.append(
                StackWarning(
                    key="cloud.upgrade_policy",
                    message=(
                        f"Kubernetes {cloud.kubernetes_version} has been in paid extended support since "
                        f"{ends.isoformat()}"
                    ),
                )
            )
    return warnings
