"""Kubernetes manifests of a stack, as plain objects (pure: no I/O, no cluster).

`llmctl render` writes them as YAML; the Pulumi program applies these same objects.
Rendering refuses a stack whose capacity plan fails, because the worker-group bounds come
from that plan and a manifest that cannot schedule is worse than none.
"""

from __future__ import annotations

from typing import Any

import yaml

from infra.plan.planner import StackPlan, plan_stack
from infra.render.dcgm import dcgm_objects
from infra.render.gateway import gateway_objects
from infra.render.namespace import namespace_object
from infra.render.rayservice import rayservice
from infra.spec.schema import StackSpec


class RenderRefused(Exception):
    def __init__(self, plan: StackPlan) -> None:
        self.plan = plan
        reasons = "; ".join(f"{p.subject}: {p.message}" for p in plan.problems)
        super().__init__(f"stack {plan.stack} does not pass `llmctl plan`: {reasons}")


def render_stack(
    spec: StackSpec,
    plan: StackPlan | None = None,
    *,
    gcs_redis_address: str | None = None,
    model_cache_bucket: str | None = None,
) -> list[dict[str, Any]]:
    """`gcs_redis_address`: the Redis Ray GCS uses, when only the Pulumi program knows it
    (ElastiCache's TLS endpoint); see `rayservice.redis_address`. `model_cache_bucket`: the
    stack's S3 model cache (`infra.plan.cache_layout.bucket_name`), needed when a model is cached; the
    gateway keeps its Batch API files there too (without it, the gateway serves no Batch API)."""
    plan = plan or plan_stack(spec)
    if not plan.ok:
        raise RenderRefused(plan)
    return [
        namespace_object(spec),
        rayservice(spec, plan, gcs_redis_address, model_cache_bucket),
        *gateway_objects(spec, plan, model_cache_bucket),
        *dcgm_objects(spec),
    ]


class _ManifestDumper(yaml.SafeDumper):
    """Block style for multi-line strings (serveConfigV2 stays readable); no YAML anchors,
    which kubectl accepts but reviewers and some tools do not."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ManifestDumper.add_representer(str, _str)


def to_yaml(objects: list[dict[str, Any]]) -> str:
    return yaml.dump_all(objects, Dumper=_ManifestDumper, sort_keys=False)


def manifest_filename(obj: dict[str, Any]) -> str:
    return f"{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
