"""Which IAM principal an ARN names, and whether the deploying identity is among the stack's admins (pure).

EKS gives the identity that creates a cluster a cluster-admin access entry of its own
(`bootstrap_cluster_creator_admin_permissions`, infra/aws/cluster.py) and refuses a second
access entry for the same principal (ResourceInUseException). A stack whose
`cloud.admin_principal_arns` names the identity running `pulumi up` would therefore fail after
the cluster exists, half built. The program and `llmctl doctor` both refuse it up front.

The identity running `pulumi up` is what STS GetCallerIdentity answers: a user
(`arn:aws:iam::<account>:user/<path/><name>`) or a role session
(`arn:aws:sts::<account>:assumed-role/<role name>/<session>`, which drops the role's path). EKS
bootstraps the role itself, so a role ARN in the list matches a session of that role by account
and role name, whatever its path.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Principal(NamedTuple):
    account: str
    kind: str
    """`role` or `user`; anything else (root, federated users) never matches an access entry ARN."""
    name: str


_IAM = re.compile(r"arn:aws[a-z-]*:iam::(\d{12}):(role|user)/(?:[^:]*/)?([^/:]+)")
_SESSION = re.compile(r"arn:aws[a-z-]*:sts::(\d{12}):assumed-role/([^/:]+)/[^:]+")


def principal(arn: str) -> Principal | None:
    """The IAM role or user an ARN stands for (a role session stands for its role)."""
    if match := _IAM.fullmatch(arn):
        return Principal(*match.groups())
    if match := _SESSION.fullmatch(arn):
        return Principal(match.group(1), "role", match.group(2))
    return None


def deploying_identity_among_admins(caller_arn: str, admin_arns: list[str]) -> int | None:
    """The index in `admin_arns` of the identity `caller_arn` names, or None."""
    caller = principal(caller_arn)
    if caller is None:
        return None
    return next((i for i, arn in enumerate(admin_arns) if principal(arn) == caller), None)


def deploying_identity_problem(stack: str, caller_arn: str, admin_arns: list[str]) -> str | None:
    """What to tell the user when the deploying identity is one of the stack's admin principals."""
    index = deploying_identity_among_admins(caller_arn, admin_arns)
    if index is None:
        return None
    return (
        f"Pulumi.{stack}.yaml: llmstack:cloud.admin_principal_arns[{index}] ({admin_arns[index]}) is the "
        f"identity running `pulumi up` ({caller_arn}). EKS already makes that identity cluster admin when it "
        "creates the cluster and refuses a second access entry for it, so the deploy would stop half built. "
        f"Remove admin_principal_arns[{index}] from the stack file (the identity stays admin), or deploy as "
        "another identity"
    )
