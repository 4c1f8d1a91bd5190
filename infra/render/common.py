"""Names and labels every rendered object agrees on.

The NetworkPolicy selects pods by these labels and the gateway finds Ray Serve by these
names, so they live in one place.
"""

from __future__ import annotations

from typing import Any

NAMESPACE = "llmstack"
RAYSERVICE_NAME = "llmstack"
GATEWAY_NAME = "llmstack-gateway"
REDIS_SECRET = "llmstack-redis"  # the gateway's Redis user; keys: url, username, password (Pulumi program)
REDIS_RAY_SECRET = "llmstack-redis-ray"  # Ray GCS's Redis user; keys: username, password (Pulumi program)
REDIS_AUTOSCALER_SECRET = "llmstack-redis-autoscaler"  # Serve controller's read-only Redis user; key: url
HF_TOKEN_SECRET = "llmstack-hf-token"  # key: token (optional: public models need none)
REDIS_SERVICE = "llmstack-redis"  # in-cluster Redis, or an ExternalName to ElastiCache
RAY_SERVICE_ACCOUNT = "llmstack-ray"  # IRSA: read-only access to the stack's model cache (AWS)
# Ray workers' own account: the same read-only cache access, and no Kubernetes API token (workers
# run tenant input through vLLM; KubeRay binds its autoscaler Role to the head's account only).
RAY_WORKER_SERVICE_ACCOUNT = "llmstack-ray-worker"
GATEWAY_SERVICE_ACCOUNT = "llmstack-gateway"  # IRSA: the Batch API's files under batches/ in that bucket (AWS)
NODE_GROUP_LABEL = "llmstack.dev/node-group"  # set on nodes by the Pulumi node groups
COMPONENT_LABEL = "llmstack.dev/component"
KUBERAY_NAMESPACE = "kuberay-operator"

# KubeRay names the Service that fronts Ray Serve "<rayservice>-serve-svc".
SERVE_SERVICE = f"{RAYSERVICE_NAME}-serve-svc"
# ... and the RayService's own head Service (dashboard, port 8265) "<rayservice>-head-svc"
# (KubeRay ray-operator/controllers/ray/utils/util.go GenerateHeadServiceName, case RayServiceCRD).
HEAD_SERVICE = f"{RAYSERVICE_NAME}-head-svc"


def labels(component: str, stack: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/part-of": "llmstack",
        "app.kubernetes.io/managed-by": "llmstack",
        "llmstack.dev/stack": stack,
        COMPONENT_LABEL: component,
    }


def metadata(name: str, component: str, stack: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "namespace": NAMESPACE, "labels": labels(component, stack), **extra}


def secret_env(name: str, secret: str, key: str, *, optional: bool = False) -> dict[str, Any]:
    """An env var read from a Secret: secrets are referenced by name, never inlined."""
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}
