"""The gateway's Kubernetes objects, and the NetworkPolicy that makes it the only way in.

The gateway is the product's security boundary: the Ray cluster must never face users.
So the gateway's Service is the stack's only load balancer, and a NetworkPolicy lets
nothing but gateway pods (and Ray itself, and the KubeRay operator's health checks)
reach Ray pods. Secrets (the Redis URL) are referenced by name, never inlined.
"""

from __future__ import annotations

import json
from typing import Any

from infra.render.common import (
    COMPONENT_LABEL,
    GATEWAY_NAME,
    KUBERAY_NAMESPACE,
    NAMESPACE,
    REDIS_SECRET,
    SERVE_SERVICE,
    labels,
    metadata,
    secret_env,
)
from infra.render.serve_config import SERVE_PORT, SERVING_PATH, ServingPath, model_routes
from infra.spec import StackSpec

PRESTOP_SLEEP_S = 10
RAY_DASHBOARD_PORT = 8265
RAY_DASHBOARD_AGENT_PORT = 52365  # KubeRay reads Serve health from the dashboard agent


def gateway_objects(spec: StackSpec) -> list[dict[str, Any]]:
    return [_deployment(spec), _service(spec), _autoscaler(spec), _disruption_budget(spec),
            _ray_network_policy(spec)]


def _selector() -> dict[str, str]:
    return {COMPONENT_LABEL: "gateway"}


def gateway_settings(spec: StackSpec, path: ServingPath = SERVING_PATH) -> str:
    """Non-secret gateway settings, as one JSON env var the gateway validates at start.
    `path`: the serving path the Serve config was rendered for (where each model lives)."""
    g = spec.gateway
    return json.dumps({
        "host": "0.0.0.0",  # in a pod; probes and the Service reach the pod IP, not loopback
        "port": g.port,
        "default_limits": g.default_limits.model_dump(),
        "max_tokens_ceiling": g.max_tokens_ceiling,
        "max_n": g.max_n,
        "max_top_logprobs": g.max_top_logprobs,
        "allow_logit_bias": g.allow_logit_bias,
        "max_body_bytes": g.max_body_bytes,
        "limiter_fail_mode": g.limiter_fail_mode,
        "upstream_idle_timeout_s": g.upstream_idle_timeout_s,
        "request_timeout_s": g.request_timeout_s,
        "key_cache_ttl_s": g.key_cache_ttl_s,
        "log_prompts": g.log_prompts,
        "models": [m.model_name for m in spec.models],
        "model_context_lengths": {m.model_name: m.max_model_len for m in spec.models},
        "model_routes": model_routes(spec, path),
    }, sort_keys=True)


def _deployment(spec: StackSpec) -> dict[str, Any]:
    port = spec.gateway.port
    probe = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10}
    container = {
        "name": "gateway",
        "image": spec.versions.gateway_image,
        "ports": [{"name": "http", "containerPort": port}],
        "env": [
            {"name": "LLMSTACK_UPSTREAM_URL", "value": f"http://{SERVE_SERVICE}.{NAMESPACE}.svc.cluster.local:{SERVE_PORT}"},
            {"name": "LLMSTACK_GATEWAY_SETTINGS", "value": gateway_settings(spec)},
            secret_env("LLMSTACK_REDIS_URL", REDIS_SECRET, "url"),
        ],
        # Endpoints are removed while SIGTERM is delivered, not before: keep accepting for a few
        # seconds so the load balancer stops sending here first, then uvicorn drains in-flight
        # streams (shutdown_grace_s, 90 s); both fit in the pod's 120 s grace period.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "readinessProbe": {**probe, "httpGet": {"path": "/readyz", "port": "http"}},
        "livenessProbe": probe,
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(GATEWAY_NAME, "gateway", spec.name),
        "spec": {
            "replicas": spec.gateway.min_replicas,
            "selector": {"matchLabels": _selector()},
            "template": {
                "metadata": {"labels": labels("gateway", spec.name)},
                "spec": {
                    "automountServiceAccountToken": False,
                    # Long enough to finish in-flight streams after SIGTERM.
                    "terminationGracePeriodSeconds": 120,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
                    "topologySpreadConstraints": [{
                        "maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                        "whenUnsatisfiable": "ScheduleAnyway", "labelSelector": {"matchLabels": _selector()}}],
                    "containers": [container],
                },
            },
        },
    }


def _service(spec: StackSpec) -> dict[str, Any]:
    tls = spec.gateway.certificate_arn is not None
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(GATEWAY_NAME, "gateway", spec.name),
        "spec": {
            "selector": _selector(),
            "ports": [{"name": "https" if tls else "http", "port": 443 if tls else 80, "targetPort": "http"}],
        },
    }
    if spec.cloud.provider == "aws":
        annotations = {
            "service.beta.kubernetes.io/aws-load-balancer-type": "external",
            "service.beta.kubernetes.io/aws-load-balancer-nlb-target-type": "ip",
            "service.beta.kubernetes.io/aws-load-balancer-scheme": "internet-facing",
        }
        if tls:
            annotations["service.beta.kubernetes.io/aws-load-balancer-ssl-cert"] = spec.gateway.certificate_arn
            annotations["service.beta.kubernetes.io/aws-load-balancer-ssl-ports"] = "https"
        service["metadata"]["annotations"] = annotations
        service["spec"]["type"] = "LoadBalancer"
    return service


def _autoscaler(spec: StackSpec) -> dict[str, Any]:
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(GATEWAY_NAME, "gateway", spec.name),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": GATEWAY_NAME},
            "minReplicas": spec.gateway.min_replicas,
            "maxReplicas": spec.gateway.max_replicas,
            "metrics": [{"type": "Resource", "resource": {
                "name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}}}],
        },
    }


def _disruption_budget(spec: StackSpec) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(GATEWAY_NAME, "gateway", spec.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector()}},
    }


def _ray_network_policy(spec: StackSpec) -> dict[str, Any]:
    ray_pods = {"matchLabels": {COMPONENT_LABEL: "ray"}}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": KUBERAY_NAMESPACE}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata("llmstack-ray-ingress", "ray", spec.name),
        "spec": {
            "podSelector": ray_pods,
            "policyTypes": ["Ingress"],
            "ingress": [
                # Ray nodes talk to each other on many ports (GCS, object store, workers).
                {"from": [{"podSelector": ray_pods}]},
                {"from": [{"podSelector": {"matchLabels": _selector()}}],
                 "ports": [{"protocol": "TCP", "port": SERVE_PORT}]},
                {"from": [operator], "ports": [{"protocol": "TCP", "port": p}
                                               for p in (RAY_DASHBOARD_PORT, RAY_DASHBOARD_AGENT_PORT, SERVE_PORT)]},
            ],
        },
    }
