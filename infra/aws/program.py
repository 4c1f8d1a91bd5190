"""What `pulumi up` builds for one stack, in the order it builds it.

`infra/__main__.py` calls `main()`; the tests call the same function under Pulumi's mocks.
The stack file is read once (`infra.spec.stack_file`) and must pass `llmctl plan` before any
resource is declared; the Kubernetes objects come from `infra.render.render_stack`, so
`pulumi up` applies exactly what `llmctl render` prints.

Secret config (never in the stack spec, always `pulumi config set --secret`):
- `llmstack:hf_token`: Hugging Face token for gated models (optional).
- `llmstack:redis_password`, `llmstack:redis_ray_password`: the gateway's and Ray's users of an
  `external` Redis (required for that mode).
- `llmstack:redis_autoscaler_password`: Serve's controller's read-only user of an `external`
  Redis (required for that mode when a model uses `autoscaling.policy: saturation`).

The stack's `aws:` settings (profile, assumeRoles, allowedAccountIds, ...) configure the
explicit AWS provider the same way they would configure Pulumi's default one: an explicit
provider reads none of them by itself. The region is the spec's; an `aws:region` that says
otherwise is refused rather than silently ignored.

The model cache bucket is named by `infra.plan.cache_layout.bucket_name`: the stack file's
`llmstack:model_cache.bucket`, or a name made from the stack and the AWS account the
program runs in (so `llmctl models sync` can find it without Pulumi).
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from infra.aws.addons import STORAGE_CLASS, Addons, AddonsArgs
from infra.aws.cluster import SYSTEM_GROUP, Cluster, ClusterArgs
from infra.aws.karpenter import Karpenter, KarpenterArgs
from infra.aws.managed_node_groups import GpuNodeGroups, GpuNodeGroupsArgs
from infra.aws.model_cache import ModelCache, ModelCacheArgs
from infra.aws.network import Network, NetworkArgs
from infra.aws.redis import Redis, RedisArgs, autoscaler_password_required
from infra.aws.workloads import Workloads, WorkloadsArgs, app_namespace
from infra.catalog.versions import CLUSTER_AUTOSCALER_IMAGE_TAGS, KARPENTER_KUBERNETES_VERSIONS
from infra.plan.cache_layout import bucket_name
from infra.plan.planner import StackPlan, plan_stack
from infra.render import render_stack
from infra.render.serve_config import scales_on_saturation
from infra.spec.principals import deploying_identity_problem
from infra.spec.schema import AwsCloud, CpuNodeGroup, ExternalRedis, GpuNodeGroup, LocalRedis, StackSpec
from infra.spec.stack_file import StackFileError, load_stack

# `aws:` settings that are secrets in a stack file; read with Pulumi's secret accessors.
SECRET_AWS_SETTINGS = {"accessKey", "secretKey", "token"}
# Provider arguments the program sets itself (the region is the spec's).
OWN_AWS_SETTINGS = {"region", "default_tags"}


class StackRefused(pulumi.RunError):
    """A stack `pulumi up` will not deploy. Pulumi prints the message without a traceback."""


def cluster_name(spec: StackSpec) -> str:
    return f"llmstack-{spec.name}"


def checked_stack(stack: str) -> tuple[StackSpec, StackPlan]:
    """The stack's spec and plan, or StackRefused saying what to change in which file."""
    try:
        spec = load_stack(stack)
    except StackFileError as exc:
        raise StackRefused(str(exc)) from None
    where = f"Pulumi.{spec.name}.yaml"
    if not isinstance(spec.cloud, AwsCloud):
        raise StackRefused(
            f"stack {spec.name} runs on this machine ({where}: llmstack:cloud.provider is "
            f"{spec.cloud.provider!r}): there is nothing to provision. Run it with `make dev`; "
            "deploy a cloud stack (provider: aws) such as dev or prod"
        )
    version, provisioner = spec.cloud.kubernetes_version, spec.cloud.node_provisioner
    supported = CLUSTER_AUTOSCALER_IMAGE_TAGS if provisioner == "cluster-autoscaler" else KARPENTER_KUBERNETES_VERSIONS
    if version not in supported:
        raise StackRefused(
            f"{where}: llmstack:cloud.kubernetes_version {version} has no {provisioner} release pinned in "
            f"infra/catalog/versions.py; use one of {', '.join(sorted(supported))}"
        )
    for i, group in enumerate(spec.node_groups):
        if isinstance(group, CpuNodeGroup):
            raise StackRefused(
                f"{where}: llmstack:node_groups[{i}] ({group.name}) is kind: cpu; "
                "AWS stacks provision GPU node groups only, use kind: gpu"
            )
        if group.name == SYSTEM_GROUP:
            raise StackRefused(
                f"{where}: llmstack:node_groups[{i}].name {SYSTEM_GROUP!r} is reserved for the "
                "cluster's system node group; choose another name"
            )
    plan = plan_stack(spec)
    if not plan.ok:
        reasons = "; ".join(f"{p.subject}: {p.message}" for p in plan.problems)
        raise StackRefused(f"stack {spec.name} does not pass `llmctl plan` ({where}): {reasons}")
    return spec, plan


def aws_settings(config: pulumi.Config) -> dict[str, Any]:
    """The stack's `aws:` settings as `pulumi_aws.Provider` arguments (pulumi-aws 7.51.1 names:
    `aws:assumeRoles` -> `assume_roles`, ...). Structured values are JSON in Pulumi's config."""
    settings: dict[str, Any] = {}
    for argument in inspect.signature(aws.Provider._internal_init).parameters:
        if argument in OWN_AWS_SETTINGS or argument.startswith("_") or argument in ("self", "resource_name", "opts"):
            continue
        key = argument.split("_")[0] + "".join(part.title() for part in argument.split("_")[1:])
        value = config.get_secret(key) if key in SECRET_AWS_SETTINGS else config.get(key)
        if value is None:
            continue
        if isinstance(value, str) and (
            value.startswith(("[", "{"))
            or value in ("true", "false")
            or (value.isdigit() and argument.endswith(("retries", "capacity")))
        ):
            value = json.loads(value)  # structured, boolean and numeric settings; a profile stays a string
        settings[argument] = value
    return settings


def assumed_role(settings: dict[str, Any]) -> str | None:
    """The role Pulumi finally acts as when the stack assumes a chain of roles."""
    roles = settings.get("assume_roles") or []
    last = roles[-1] if roles else {}
    return last.get("roleArn") or last.get("role_arn")


def build(spec: StackSpec, plan: StackPlan) -> dict[str, pulumi.Output]:
    """Declare every resource of the stack; return the stack outputs."""
    assert isinstance(spec.cloud, AwsCloud)
    assert not isinstance(spec.redis, LocalRedis)  # the spec keeps redis.mode local to local stacks
    cloud, name = spec.cloud, cluster_name(spec)
    secrets = pulumi.Config("llmstack")
    aws_config = pulumi.Config("aws")
    configured_region = aws_config.get("region")
    if configured_region and configured_region != cloud.region:
        raise StackRefused(
            f"Pulumi.{spec.name}.yaml: aws:region is {configured_region} but llmstack:cloud.region is "
            f"{cloud.region}; make them equal (or remove aws:region)"
        )
    external = isinstance(spec.redis, ExternalRedis)
    autoscaler_password = secrets.get_secret("redis_autoscaler_password") if external else None
    if external and scales_on_saturation(spec) and autoscaler_password is None:
        raise StackRefused(autoscaler_password_required(spec.name))
    settings = aws_settings(aws_config)
    aws_provider = aws.Provider(
        "aws",
        region=cloud.region,
        **settings,
        default_tags=aws.ProviderDefaultTagsArgs(
            tags={"llmstack.dev/stack": spec.name, "llmstack.dev/managed-by": "pulumi"}
        ),
    )
    on_aws = pulumi.ResourceOptions(providers={"aws": aws_provider})
    # Asked before anything is declared: an admin entry for this identity would fail the deploy
    # once the cluster exists (infra/spec/principals.py).
    identity = aws.get_caller_identity(opts=pulumi.InvokeOptions(provider=aws_provider))
    problem = deploying_identity_problem(spec.name, identity.arn, cloud.admin_principal_arns)
    if problem:
        raise StackRefused(problem)

    network = Network(
        "network",
        NetworkArgs(cluster_name=name, region=cloud.region, availability_zones=cloud.availability_zones),
        opts=on_aws,
    )
    cluster = Cluster(
        "eks",
        ClusterArgs(
            name=name,
            kubernetes_version=cloud.kubernetes_version,
            region=cloud.region,
            private_subnet_ids=network.private_subnet_ids,
            upgrade_policy=cloud.upgrade_policy,
            public_access_cidrs=cloud.api_public_cidrs,
            admin_principal_arns=cloud.admin_principal_arns,
            aws_profile=settings.get("profile"),
            assume_role_arn=assumed_role(settings),
        ),
        opts=on_aws,
    )
    # Node groups and add-ons name the cluster by its (known) name, so they wait for it explicitly.
    after_cluster = pulumi.ResourceOptions.merge(on_aws, pulumi.ResourceOptions(depends_on=[cluster]))
    karpenter = cloud.node_provisioner == "karpenter"
    gpu_groups = [g for g in spec.node_groups if isinstance(g, GpuNodeGroup)]
    # Every Kubernetes object goes through this provider, once the system nodes are up.
    kube = k8s.Provider("k8s", kubeconfig=cluster.kubeconfig, opts=pulumi.ResourceOptions(depends_on=[cluster]))

    addons = Addons(
        "addons",
        AddonsArgs(
            cluster_name=name,
            kubernetes_version=cloud.kubernetes_version,
            region=cloud.region,
            vpc_id=network.vpc_id,
            oidc_provider_arn=cluster.oidc_provider_arn,
            oidc_issuer=cluster.oidc_issuer,
            k8s_provider=kube,
            kuberay_version=spec.versions.kuberay_operator,
            cluster_autoscaler=not karpenter,
        ),
        opts=after_cluster,
    )
    if karpenter:
        gpu: pulumi.Resource = Karpenter(
            "karpenter",
            KarpenterArgs(
                spec=spec,
                cluster_name=name,
                cluster_endpoint=cluster.endpoint,
                region=cloud.region,
                account_id=identity.account_id,
                oidc_provider_arn=cluster.oidc_provider_arn,
                oidc_issuer=cluster.oidc_issuer,
                subnet_ids=network.private_subnet_ids,
                security_group_id=cluster.node_security_group_id,
                k8s_provider=kube,
                after=[addons.load_balancer_controller],
            ),
            opts=after_cluster,
        )
    else:
        gpu = GpuNodeGroups(
            "gpu",
            GpuNodeGroupsArgs(
                cluster_name=name,
                node_role_arn=cluster.node_role_arn,
                subnet_ids=network.private_subnet_ids,
                groups=gpu_groups,
            ),
            opts=after_cluster,
        )

    cache_bucket = bucket_name(spec, None if spec.model_cache.bucket else identity.account_id)
    rendered = render_stack(spec, plan, model_cache_bucket=cache_bucket)
    # Our Kubernetes objects all live in this namespace, so creating it after the add-ons means
    # none of them meets a half-installed webhook, CRD or StorageClass. AWS resources
    # (ElastiCache) do not wait for it.
    namespace = app_namespace(rendered[0], kube, pulumi.ResourceOptions(depends_on=[addons]))
    redis = Redis(
        "redis",
        RedisArgs(
            stack=spec.name,
            redis=spec.redis,
            k8s_provider=kube,
            namespace=namespace,
            vpc_id=network.vpc_id,
            subnet_ids=network.private_subnet_ids,
            node_security_group_id=cluster.node_security_group_id,
            storage_class=STORAGE_CLASS,
            external_passwords=(secrets.require_secret("redis_password"), secrets.require_secret("redis_ray_password"))
            if external
            else None,
            autoscaler=scales_on_saturation(spec),
            external_autoscaler_password=autoscaler_password,
        ),
        opts=on_aws,
    )
    cache = ModelCache(
        "model-cache",
        ModelCacheArgs(
            stack=spec.name,
            bucket=cache_bucket,
            oidc_provider_arn=cluster.oidc_provider_arn,
            oidc_issuer=cluster.oidc_issuer,
            k8s_provider=kube,
            namespace=namespace,
            batch_retention_days=spec.gateway.batch.retention_days,
        ),
        opts=on_aws,
    )
    app = Workloads(
        "app",
        WorkloadsArgs(
            stack=spec.name,
            objects=rendered[1:],
            tls=spec.gateway.certificate_arn is not None,
            namespace=namespace,
            k8s_provider=kube,
            hf_token=secrets.get_secret("hf_token"),
            gcs_redis_address=redis.gcs_address,
        ),
        # Ray and gateway pods run as the cache's service accounts, so those must exist before them.
        opts=pulumi.ResourceOptions(depends_on=[addons, redis, gpu, cache]),
    )

    return {
        "endpoint_url": app.endpoint_url,
        "cluster_name": cluster.name,
        "kubeconfig": cluster.kubeconfig,
        "redis_endpoint": redis.endpoint,
        "model_cache_bucket": cache.bucket,
    }


def main() -> dict[str, pulumi.Output]:
    spec, plan = checked_stack(pulumi.get_stack())
    outputs = build(spec, plan)
    for key, value in outputs.items():
        pulumi.export(key, value)
    return outputs
