"""The Pulumi program, run for real under Pulumi's own mocks (`pulumi.runtime.set_mocks`).

Every resource the program declares reaches the mock monitor with its inputs; the mocks
answer with the outputs AWS or Kubernetes would compute (IDs, ASG names, endpoints). The
tests then read the resource graph: node groups, ASG tags, charts, Redis, and the objects
handed to Kubernetes, which must equal `llmctl render`'s output for the same stack.

`test_pulumi_policies.py` checks security rules over the same graphs (`run_program`).
Runs happen in this process, one after another: `set_mocks` installs a fresh monitor and
settings each time, and the config map is replaced before each run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra.aws.program import StackRefused
from infra.catalog import versions
from infra.catalog.gpu_catalog import load_catalog
from infra.catalog.versions import KUBERAY_VERSION
from infra.plan.cache_layout import bucket_name
from infra.render import render_stack
from infra.spec.schema import CapacityType, GpuNodeGroup, StackSpec
from infra.spec.stack_file import load_stack
from tests.support.pulumi_program import (
    CLOUD_STACKS,
    ELASTICACHE_HOST,
    MOCK_ACCOUNT,
    MOCK_PASSWORD,
    NODE_SECURITY_GROUP,
    REDACTED,
    asg_name,
    example_run,
    mock_arn,
    run_program,
)
from tests.support.stacks import stack_document, write_stack


def gpu_groups(spec: StackSpec) -> list[GpuNodeGroup]:
    return [g for g in spec.node_groups if isinstance(g, GpuNodeGroup)]


# --- node groups and the autoscaler's view of them ---------------------------------------

# The Cluster Autoscaler's AWS GPU label: a node carrying it counts as "GPU not ready yet" until
# the device plugin advertises nvidia.com/gpu, instead of triggering another scale-up.
ACCELERATOR = {"L4": "nvidia-l4", "A10G": "nvidia-a10g", "L40S": "nvidia-l40s", "A100-80GB": "nvidia-tesla-a100"}
EXPECTED_GPU_GROUPS = {
    "dev": {"l4": ("g6.2xlarge", "L4", 1)},
    "prod": {
        "a100": ("p4de.24xlarge", "A100-80GB", 8),
        "l40s": ("g6e.xlarge", "L40S", 1),
        "a10g-spot": ("g5.2xlarge", "A10G", 1),
    },
}


@pytest.mark.parametrize("stack", CLOUD_STACKS)
def test_one_managed_node_group_per_gpu_group(stack: str) -> None:
    run, spec = example_run(stack), load_stack(stack)
    groups = {r.inputs["nodeGroupName"]: r for r in run.of_type("aws:eks/nodeGroup:NodeGroup")}
    assert set(groups) == {*EXPECTED_GPU_GROUPS[stack], "system"}
    for group in gpu_groups(spec):
        instance_type, gpu_class, _ = EXPECTED_GPU_GROUPS[stack][group.name]
        inputs = groups[group.name].inputs
        assert inputs["instanceTypes"] == [instance_type]
        assert inputs["amiType"] == "AL2023_x86_64_NVIDIA"
        assert inputs["capacityType"] == ("SPOT" if group.capacity_type is CapacityType.SPOT else "ON_DEMAND")
        assert inputs["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NO_SCHEDULE"}]
        assert inputs["labels"] == {
            "llmstack.dev/node-group": group.name,
            "llmstack.dev/gpu-class": gpu_class,
            "nvidia.com/gpu.present": "true",
            "k8s.amazonaws.com/accelerator": ACCELERATOR[gpu_class],
        }
        assert inputs["scalingConfig"] == {
            "minSize": group.min_size,
            "maxSize": group.max_size,
            "desiredSize": group.desired,
        }
        template = run.by_id(inputs["launchTemplate"]["id"])
        assert template.inputs["blockDeviceMappings"][0]["ebs"]["volumeSize"] == group.disk_size_gib
    assert groups["system"].inputs["labels"] == {"llmstack.dev/node-group": "system"}
    assert "taints" not in groups["system"].inputs


def test_prod_capacity_types_follow_the_spec() -> None:
    groups = {r.inputs["nodeGroupName"]: r.inputs for r in example_run("prod").of_type("aws:eks/nodeGroup:NodeGroup")}
    assert groups["a10g-spot"]["capacityType"] == "SPOT"
    assert groups["a100"]["capacityType"] == groups["l40s"]["capacityType"] == "ON_DEMAND"
    assert groups["a10g-spot"]["scalingConfig"]["minSize"] == 0  # scale from zero needs the ASG tags below


@pytest.mark.parametrize("stack", CLOUD_STACKS)
def test_scale_from_zero_tags_are_on_each_autoscaling_group(stack: str) -> None:
    run = example_run(stack)
    cluster = f"llmstack-{stack}"
    for node_group in run.of_type("aws:eks/nodeGroup:NodeGroup"):
        name = node_group.inputs["nodeGroupName"]
        if name == "system":
            continue
        tags = [
            t.inputs
            for t in run.of_type("aws:autoscaling/tag:Tag")
            if t.inputs["autoscalingGroupName"] == asg_name(node_group.name)
        ]
        _, gpu_class, gpus = EXPECTED_GPU_GROUPS[stack][name]
        template = "k8s.io/cluster-autoscaler/node-template"
        assert {t["tag"]["key"]: t["tag"]["value"] for t in tags} == {
            f"{template}/label/llmstack.dev/node-group": name,
            f"{template}/label/llmstack.dev/gpu-class": gpu_class,
            f"{template}/label/nvidia.com/gpu.present": "true",
            f"{template}/label/k8s.amazonaws.com/accelerator": ACCELERATOR[gpu_class],
            f"{template}/taint/nvidia.com/gpu": "true:NoSchedule",
            f"{template}/resources/nvidia.com/gpu": str(gpus),
            "k8s.io/cluster-autoscaler/enabled": "true",
            f"k8s.io/cluster-autoscaler/{cluster}": "owned",
        }
        assert gpus == load_catalog()[node_group.inputs["instanceTypes"][0]].gpus
        assert all(t["tag"]["propagateAtLaunch"] is False for t in tags)
    # Every tag went to a GPU group's ASG, none to a name the node groups do not have.
    known = {asg_name(g.name) for g in run.of_type("aws:eks/nodeGroup:NodeGroup")}
    assert {t.inputs["autoscalingGroupName"] for t in run.of_type("aws:autoscaling/tag:Tag")} <= known


# --- add-ons -----------------------------------------------------------------------------


@pytest.mark.parametrize("stack", CLOUD_STACKS)
def test_charts_are_pinned(stack: str) -> None:
    run = example_run(stack)
    charts = {c.name: c.inputs for c in run.of_type("kubernetes:helm.sh/v4:Chart")}
    pinned = {
        pin.name: pin
        for pin in (
            versions.NVIDIA_DEVICE_PLUGIN_CHART,
            versions.CLUSTER_AUTOSCALER_CHART,
            versions.LOAD_BALANCER_CONTROLLER_CHART,
            versions.METRICS_SERVER_CHART,
            versions.KUBERAY_OPERATOR_CHART,
        )
    }
    assert set(charts) == set(pinned)
    for name, (repo, chart, version) in pinned.items():
        assert charts[name]["chart"] == chart
        assert charts[name]["version"] == version
        assert charts[name]["repositoryOpts"]["repo"] == repo
        assert version[0].isdigit() and not any(c in version for c in "^~*<>x ")
    assert charts["kuberay-operator"]["version"] == KUBERAY_VERSION == "1.7.0"
    assert charts["kuberay-operator"]["namespace"] == "kuberay-operator"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in charts["nvidia-device-plugin"][
        "values"
    ]["tolerations"]
    autoscaler = charts["cluster-autoscaler"]["values"]
    assert autoscaler["autoDiscovery"]["clusterName"] == f"llmstack-{stack}"
    assert autoscaler["image"]["tag"].startswith(f"v{load_stack(stack).cloud.kubernetes_version}.")
    run.one("aws:iam/role:Role", "addons-cluster-autoscaler")
    assert autoscaler["rbac"]["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"] == mock_arn(
        "addons-cluster-autoscaler"
    )


def test_autoscaler_role_is_only_for_its_service_account() -> None:
    run = example_run("prod")
    trust = json.loads(run.one("aws:iam/role:Role", "addons-cluster-autoscaler").inputs["assumeRolePolicy"])
    [statement] = trust["Statement"]
    assert statement["Action"] == "sts:AssumeRoleWithWebIdentity"
    conditions = statement["Condition"]["StringEquals"]
    issuer = "oidc.eks.us-east-1.amazonaws.com/id/ABC"
    assert conditions == {
        f"{issuer}:sub": "system:serviceaccount:kube-system:cluster-autoscaler",
        f"{issuer}:aud": "sts.amazonaws.com",
    }
    policy = json.loads(run.one("aws:iam/rolePolicy:RolePolicy", "addons-cluster-autoscaler").inputs["policy"])
    scale = next(s for s in policy["Statement"] if "autoscaling:SetDesiredCapacity" in s["Action"])
    assert scale["Condition"] == {"StringEquals": {"aws:ResourceTag/k8s.io/cluster-autoscaler/llmstack-prod": "owned"}}


# --- Redis -------------------------------------------------------------------------------


def test_elasticache_is_encrypted_authenticated_and_reachable_only_from_nodes() -> None:
    run = example_run("prod")
    [group] = run.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    inputs = group.inputs
    assert inputs["transitEncryptionEnabled"] is True
    assert inputs["atRestEncryptionEnabled"] is True
    # Authenticated by RBAC users (tests/infra/aws/test_redis.py), not a shared AUTH token.
    assert "authToken" not in inputs and inputs["userGroupIds"]
    assert inputs["numCacheClusters"] == 2 and inputs["automaticFailoverEnabled"] is True
    passwords = run.of_type("random:index/randomPassword:RandomPassword")
    assert passwords and all(p.inputs["special"] is False for p in passwords)  # ElastiCache rejects some punctuation
    [firewall_id] = inputs["securityGroupIds"]
    firewall = run.by_id(firewall_id)
    assert firewall.inputs["ingress"] == [
        {
            "protocol": "tcp",
            "fromPort": 6379,
            "toPort": 6379,
            "securityGroups": [NODE_SECURITY_GROUP],
            "description": "Redis from EKS nodes",
        }
    ]
    subnets = run.one("aws:elasticache/subnetGroup:SubnetGroup", inputs["subnetGroupName"]).inputs["subnetIds"]
    assert subnets and all("private" in run.by_id(s).name for s in subnets)


@pytest.mark.parametrize(
    ("stack", "url"),
    [
        ("dev", f"redis://llmstack-gateway:{MOCK_PASSWORD}@llmstack-redis.llmstack.svc.cluster.local:6379/0"),
        ("prod", f"rediss://llmstack-gateway:{MOCK_PASSWORD}@master.llmstack.abc123.use1.cache.amazonaws.com:6379/0"),
    ],
)
def test_redis_secrets_hold_each_users_credentials_as_secrets(stack: str, url: str) -> None:
    run = example_run(stack)
    gateway = run.one("kubernetes:core/v1:Secret", "llmstack-redis")
    assert gateway.inputs["metadata"]["namespace"] == "llmstack"
    assert gateway.inputs["stringData"] == {"url": url, "username": "llmstack-gateway", "password": MOCK_PASSWORD}
    ray = run.one("kubernetes:core/v1:Secret", "llmstack-redis-ray")
    assert ray.inputs["stringData"] == {"username": "llmstack-ray", "password": MOCK_PASSWORD}
    assert gateway.redacted["stringData"] == ray.redacted["stringData"] == REDACTED
    # One generated password per user (the mock answers every RandomPassword alike).
    names = {p.name for p in run.of_type("random:index/randomPassword:RandomPassword")}
    assert {"redis-llmstack-gateway", "redis-llmstack-ray"} <= names


def test_managed_redis_gets_an_external_name_service() -> None:
    service = example_run("prod").one("kubernetes:core/v1:Service", "llmstack-redis").inputs
    assert service["spec"]["type"] == "ExternalName"
    assert service["spec"]["externalName"] == "master.llmstack.abc123.use1.cache.amazonaws.com"


def test_in_cluster_redis_is_a_password_protected_pod_on_an_encrypted_volume() -> None:
    run = example_run("dev")
    assert not run.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    deployment = run.one("kubernetes:apps/v1:Deployment", "llmstack-redis").inputs
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["args"][:2] == ["--aclfile", "/etc/redis-acl/users.acl"]
    acl = run.one("kubernetes:core/v1:Secret", "llmstack-redis-acl")
    assert acl.redacted["stringData"] == REDACTED
    lines = acl.inputs["stringData"]["users.acl"].splitlines()
    assert lines[0] == "user default off resetkeys -@all"
    assert [line.split()[1] for line in lines[1:]] == ["llmstack-gateway", "llmstack-ray"]
    assert MOCK_PASSWORD not in acl.inputs["stringData"]["users.acl"]  # hashes only
    claim = run.one("kubernetes:core/v1:PersistentVolumeClaim", "llmstack-redis-data").inputs
    assert claim["spec"]["resources"]["requests"]["storage"] == "8Gi"
    storage_class = run.one("kubernetes:storage.k8s.io/v1:StorageClass", claim["spec"]["storageClassName"]).inputs
    assert storage_class["parameters"]["encrypted"] == "true"
    service = run.one("kubernetes:core/v1:Service", "llmstack-redis").inputs["spec"]
    assert service.get("type", "ClusterIP") == "ClusterIP"
    policy = run.one("kubernetes:networking.k8s.io/v1:NetworkPolicy", "llmstack-redis-ingress").inputs["spec"]
    [rule] = policy["ingress"]
    assert rule["from"][0]["podSelector"]["matchExpressions"][0]["values"] == ["gateway", "ray"]


def _external_stack(tmp_path: Path) -> Path:
    document = stack_document(redis={"mode": "external", "host": "redis.internal.example.com", "port": 6380})
    write_stack(tmp_path, "ext", document)
    return tmp_path


EXTERNAL_SECRETS = {"llmstack:redis_password": "ext-pass", "llmstack:redis_ray_password": "ext-ray-pass"}


def test_external_redis_uses_the_secret_config_passwords_and_hf_token(tmp_path: Path) -> None:
    run = run_program(
        "ext",
        root=_external_stack(tmp_path),
        config={**EXTERNAL_SECRETS, "llmstack:hf_token": "hf_abc"},
        secret_keys=(*EXTERNAL_SECRETS, "llmstack:hf_token"),
    )
    assert not run.of_type("aws:elasticache/replicationGroup:ReplicationGroup")
    assert not run.of_type("random:index/randomPassword:RandomPassword")
    secret = run.one("kubernetes:core/v1:Secret", "llmstack-redis")
    assert secret.inputs["stringData"] == {
        "username": "llmstack-gateway",
        "password": "ext-pass",
        "url": "rediss://llmstack-gateway:ext-pass@redis.internal.example.com:6380/0",
    }
    assert run.one("kubernetes:core/v1:Secret", "llmstack-redis-ray").inputs["stringData"] == {
        "username": "llmstack-ray",
        "password": "ext-ray-pass",
    }
    assert secret.redacted["stringData"] == REDACTED
    service = run.one("kubernetes:core/v1:Service", "llmstack-redis").inputs["spec"]
    assert service["externalName"] == "redis.internal.example.com"
    hf = run.one("kubernetes:core/v1:Secret", "llmstack-hf-token")
    assert hf.inputs["stringData"] == {"token": "hf_abc"} and hf.redacted["stringData"] == REDACTED
    assert run.outputs["redis_endpoint"] == "redis.internal.example.com:6380"


@pytest.mark.parametrize("missing", EXTERNAL_SECRETS)
def test_external_redis_without_a_password_is_refused(tmp_path: Path, missing: str) -> None:
    given = {k: v for k, v in EXTERNAL_SECRETS.items() if k != missing}
    with pytest.raises(Exception, match=missing.removeprefix("llmstack:")):
        run_program("ext", root=_external_stack(tmp_path), config=given, secret_keys=tuple(given))


def test_no_hf_token_no_secret() -> None:
    assert not [s for s in example_run("dev").of_type("kubernetes:core/v1:Secret") if s.name == "llmstack-hf-token"]


# --- what Kubernetes receives is what `llmctl render` prints ------------------------------


@pytest.mark.parametrize("stack", CLOUD_STACKS)
def test_applied_objects_equal_render_stack(stack: str) -> None:
    run = example_run(stack)
    applied = [
        {key: r.inputs[key] for key in ("apiVersion", "kind", "metadata", "spec", "data") if key in r.inputs}
        for r in run.resources
        if r.within("llmstack:aws:Workloads") and r.type.startswith("kubernetes:")
    ]
    spec = load_stack(stack)
    # Managed Redis: GCS must use ElastiCache's own TLS host name, known only to the program.
    gcs = f"rediss://{ELASTICACHE_HOST}:6379" if spec.redis.mode == "managed" else None
    rendered = render_stack(spec, gcs_redis_address=gcs, model_cache_bucket=bucket_name(spec, MOCK_ACCOUNT))
    applied.append(
        {
            key: v
            for key, v in run.one("kubernetes:core/v1:Namespace", "llmstack").inputs.items()
            if key in ("apiVersion", "kind", "metadata")
        }
    )
    assert len(applied) == len(rendered)

    def key(obj: dict) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    assert sorted(applied, key=key) == sorted(rendered, key=key)
    [rayservice] = run.of_type("kubernetes:ray.io/v1:RayService")
    [rendered_rayservice] = [o for o in rendered if o["kind"] == "RayService"]
    assert rayservice.inputs["spec"] == rendered_rayservice["spec"]  # serveConfigV2 and all, unchanged


@pytest.mark.parametrize("stack", CLOUD_STACKS)
def test_creation_order(stack: str) -> None:
    """What each resource waits for, as registered with the engine (parents, `depends_on`,
    inputs): the things that break a first `pulumi up` when they race."""
    run = example_run(stack)
    chart = {c.name: c for c in run.of_type("kubernetes:helm.sh/v4:Chart")}
    [rayservice] = run.of_type("kubernetes:ray.io/v1:RayService")
    assert run.waits_for(rayservice, chart["kuberay-operator"])  # its CRD
    gateway = run.one("kubernetes:core/v1:Service", "service-llmstack-gateway")
    assert run.waits_for(gateway, chart["aws-load-balancer-controller"])  # its NLB, and the webhook
    # The controller's webhooks fail closed: nothing else may be created before it serves them.
    others = [c for name, c in chart.items() if name != "aws-load-balancer-controller"]
    assert others and all(run.waits_for(c, chart["aws-load-balancer-controller"]) for c in others)
    assert run.waits_for(rayservice, run.one("kubernetes:core/v1:Secret", "llmstack-redis"))
    namespace = run.one("kubernetes:core/v1:Namespace", "llmstack")
    ours = [
        r
        for r in run.resources
        if r.type.startswith("kubernetes:") and r.inputs.get("metadata", {}).get("namespace") == "llmstack"
    ]
    assert ours and all(run.waits_for(r, namespace) for r in ours)
    assert all(run.waits_for(namespace, c) for c in chart.values())
    [provider] = run.of_type("pulumi:providers:kubernetes")
    system = next(g for g in run.of_type("aws:eks/nodeGroup:NodeGroup") if g.inputs["nodeGroupName"] == "system")
    assert run.waits_for(provider, system)  # charts need nodes to run on
    node_policies = [
        a for a in run.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment") if a.name.startswith("eks-nodes-")
    ]
    for group in run.of_type("aws:eks/nodeGroup:NodeGroup"):
        assert node_policies and all(run.waits_for(group, a) for a in node_policies)  # or nodes never join
    [cluster] = run.of_type("aws:eks/cluster:Cluster")
    by_cluster_name = run.of_type("aws:eks/addon:Addon") + run.of_type("aws:eks/nodeGroup:NodeGroup")
    assert all(run.waits_for(r, cluster) for r in by_cluster_name)  # they name it; they must not race it
    for tag in run.of_type("aws:autoscaling/tag:Tag"):
        assert any(run.waits_for(tag, g) for g in run.of_type("aws:eks/nodeGroup:NodeGroup"))


# --- outputs -----------------------------------------------------------------------------


@pytest.mark.parametrize(("stack", "scheme"), [("dev", "http"), ("prod", "https")])
def test_outputs(stack: str, scheme: str) -> None:
    run = example_run(stack)
    assert run.outputs["endpoint_url"] == f"{scheme}://gw-123.elb.us-east-1.amazonaws.com"
    assert run.outputs["cluster_name"] == f"llmstack-{stack}"
    kubeconfig = json.loads(run.outputs["kubeconfig"])
    assert kubeconfig["users"][0]["user"]["exec"]["args"][:4] == [
        "eks",
        "get-token",
        "--cluster-name",
        f"llmstack-{stack}",
    ]
    assert run.secret_outputs == {"kubeconfig"}
    assert run.outputs["redis_endpoint"].endswith(":6379")
    assert MOCK_PASSWORD not in json.dumps({k: v for k, v in run.outputs.items() if k not in run.secret_outputs})


# --- refusals ----------------------------------------------------------------------------


def test_local_stack_is_refused() -> None:
    with pytest.raises(StackRefused, match=r"stack local runs on this machine .*nothing to provision.*make dev"):
        run_program("local")


def test_stack_that_fails_the_plan_is_refused_naming_the_problem(tmp_path: Path) -> None:
    document = stack_document(
        node_groups=[{"name": "l4", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": 1}],
        models=[
            {
                "id": "llama",
                "source": "meta-llama/Llama-3.1-8B-Instruct",
                "node_group": "l4",
                "max_model_len": 8192,
                "autoscaling": {"min_replicas": 1, "max_replicas": 3},
            }
        ],
    )
    write_stack(tmp_path, "small", document)
    with pytest.raises(StackRefused, match=r"stack small does not pass `llmctl plan`.*l4: .*raise max_size"):
        run_program("small", root=tmp_path)


def test_kubernetes_version_without_a_pinned_autoscaler_is_refused(tmp_path: Path) -> None:
    cloud = {
        "provider": "aws",
        "availability_zones": ["us-east-1a", "us-east-1b"],
        "kubernetes_version": "1.29",
        "upgrade_policy": "standard",
    }
    write_stack(tmp_path, "old", stack_document(cloud=cloud))
    with pytest.raises(StackRefused, match=r"kubernetes_version 1.29 has no cluster-autoscaler release pinned"):
        run_program("old", root=tmp_path)
    write_stack(tmp_path, "oldk", stack_document(cloud={**cloud, "node_provisioner": "karpenter"}))
    with pytest.raises(StackRefused, match=r"kubernetes_version 1.29 has no karpenter release pinned"):
        run_program("oldk", root=tmp_path)


@pytest.mark.parametrize(
    ("group", "message"),
    [
        ({"name": "cpu", "kind": "cpu", "max_size": 1}, r"node_groups\[0\] \(cpu\) is kind: cpu"),
        (
            {"name": "system", "kind": "gpu", "instance_type": "g6.xlarge", "max_size": 2},
            r"node_groups\[0\].name 'system' is reserved",
        ),
    ],
)
def test_node_groups_the_program_cannot_build_are_refused(tmp_path: Path, group: dict, message: str) -> None:
    model = {
        "id": "llama",
        "source": "meta-llama/Llama-3.1-8B-Instruct",
        "node_group": group["name"],
        "max_model_len": 8192,
    }
    write_stack(tmp_path, "odd", stack_document(node_groups=[group], models=[model]))
    with pytest.raises(StackRefused, match=message):
        run_program("odd", root=tmp_path)


def test_unknown_stack_is_refused_with_the_stack_file_error() -> None:
    with pytest.raises(StackRefused, match=r"Pulumi.nosuch.yaml: no such stack file"):
        run_program("nosuch")
