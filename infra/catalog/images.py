"""Container image references, split the way Docker and containerd read them.

A reference whose first path component has no `.` or `:` and is not `localhost` names no
registry: the runtime then pulls from Docker Hub (`llmstack-gateway:0.1.0` becomes
`docker.io/library/llmstack-gateway:0.1.0`), which for our own images does not exist, and the
pods sit in ImagePullBackOff until `pulumi up` times out. AWS stacks must therefore name the
registry host of every image we build (`infra.spec.schema` refuses them otherwise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# <account>.dkr.ecr[-fips].<region>.amazonaws.com[.cn]
_ECR_HOST = re.compile(r"^(?P<account>\d{12})\.dkr\.ecr(?:-fips)?\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?$")


@dataclass(frozen=True)
class ImageRef:
    registry: str | None
    """Registry host (and port), or None when the reference names none."""
    repository: str
    tag: str | None
    digest: str | None

    @property
    def ecr_account(self) -> str | None:
        match = _ECR_HOST.match(self.registry or "")
        return match["account"] if match else None

    @property
    def ecr_region(self) -> str | None:
        match = _ECR_HOST.match(self.registry or "")
        return match["region"] if match else None


def parse_image(reference: str) -> ImageRef:
    name, _, digest = reference.partition("@")
    first, slash, rest = name.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = None, name
    repository, colon, tag = path.rpartition(":") if ":" in path.rsplit("/", 1)[-1] else (path, "", "")
    return ImageRef(registry=registry, repository=repository, tag=tag if colon else None, digest=digest or None)


def missing_registry_problem(reference: str) -> str | None:
    """Why an image cannot be pulled by a cluster, or None when it names a registry and a version."""
    image = parse_image(reference)
    if image.registry is None:
        return (
            f"{reference!r} names no registry host, so nodes would pull it from Docker Hub, where it does "
            f"not exist; push the image and give its full name, e.g. "
            f"111122223333.dkr.ecr.us-east-1.amazonaws.com/{image.repository}:{image.tag or '0.1.0'}"
        )
    if image.tag is None and image.digest is None:
        return f"{reference!r} names no tag or digest; pin one (e.g. :0.1.0), never an implicit :latest"
    return None
