"""Metrics that others export and our dashboard and alerts read, each with where it is documented.

The gateway's own series are defined in `serving.gateway.telemetry.metrics` (`GatewayMetrics.names()`).
Everything else comes from components we run but do not write:

- Ray Serve and vLLM inside Ray Serve LLM. Ray exports metrics with a `ray_` prefix, and vLLM's
  names (`vllm:...`) reach Prometheus as `ray_vllm_...` because vLLM's Ray metric wrappers
  replace characters OpenTelemetry disallows with `_` (vllm/v1/metrics/ray_wrappers.py).
  Ray ships Grafana dashboards that query these exact names; `RAY_DASHBOARDS` below is where,
  in the installed `ray` package, and a test checks every `ray_*` name here appears there.
- kube-state-metrics (pending and crash-looping pods, DaemonSet readiness), from its documentation
  (docs/metrics/workload/pod-metrics.md and daemonset-metrics.md, v2.x: these are STABLE metrics).
- NVIDIA's DCGM exporter on GPU nodes (infra/render/dcgm.py): exactly the fields of the counters
  file rendered there (`infra.render.dcgm.FIELDS`), so the dashboard and alerts cannot read a
  field the exporter is not asked for.

Label keys of the Ray Serve metrics are as ray/serve/_private declares them (tag_keys, plus the
application/deployment/replica tags Serve sets on replica metrics).

Labels worth knowing: `ray_vllm_*` carry `model_name` (the served name clients request, the
gateway's `model`); `ray_serve_*` carry `application` and `deployment` (e.g.
`LLMServer:llama-3_1-8b-instruct`). Everything scraped from a pod also carries that pod's `pod`
and `namespace` (the scrape job's target labels, infra/render/rayservice.py). DCGM series carry
`Hostname` (the node), `gpu` (index on the node), `modelName` (the GPU's product name, NOT our
model) and, for a GPU a pod holds, that pod's `pod`/`namespace`/`container`
(dcgm-exporter 4.5.3-4.8.2 render_metrics.go and transformation/const.go). So a GPU joins to the
models a Ray pod serves on `pod`: a Ray worker pod holds all of its node's GPUs, and its
`ray_vllm_*` series name the models whose engines run in it.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from infra.render.dcgm import FIELDS as DCGM_FIELDS

MetricType = Literal["counter", "gauge", "histogram"]

# In the installed ray package: the bundled Grafana dashboard definitions.
RAY_DASHBOARDS = "ray/dashboard/modules/metrics/dashboards"
SERVE_PANELS = f"{RAY_DASHBOARDS}/serve_dashboard_panels.py"
SERVE_DEPLOYMENT_PANELS = f"{RAY_DASHBOARDS}/serve_deployment_dashboard_panels.py"
SERVE_LLM_PANELS = f"{RAY_DASHBOARDS}/serve_llm_dashboard_panels.py"
KSM_POD_METRICS = "kube-state-metrics docs/metrics/workload/pod-metrics.md"
KSM_DAEMONSET_METRICS = "kube-state-metrics docs/metrics/workload/daemonset-metrics.md"
DCGM_COUNTERS = "infra/render/dcgm.py FIELDS (NVIDIA/dcgm-exporter 4.5.3-4.8.2 etc/default-counters.csv)"
# The node's label: `Hostname` up to dcgm-exporter 4.8.2, `hostname` after it (NVIDIA/dcgm-exporter#655).
DCGM_NODE_LABEL = "Hostname"
DCGM_LABELS = ("gpu", "UUID", "pci_bus_id", "device", "modelName", DCGM_NODE_LABEL, "pod", "namespace", "container")


class ExternalMetric(NamedTuple):
    name: str  # as Prometheus stores it (counters with _total; histograms without suffix)
    type: MetricType
    labels: tuple[str, ...]
    source: str
    meaning: str


SERVING_METRICS: tuple[ExternalMetric, ...] = (
    # Ray Serve
    ExternalMetric(
        "ray_serve_num_http_requests_total",
        "counter",
        ("application", "route", "method", "status_code"),
        SERVE_PANELS,
        "HTTP requests Serve's proxy answered.",
    ),
    ExternalMetric(
        "ray_serve_num_http_error_requests_total",
        "counter",
        ("application", "route", "method", "error_code"),
        SERVE_PANELS,
        "HTTP requests Serve answered with an error.",
    ),
    ExternalMetric(
        "ray_serve_deployment_queued_queries",
        "gauge",
        ("application", "deployment", "handle"),
        SERVE_PANELS,
        "Requests waiting for a free replica slot (max_ongoing_requests reached on all replicas).",
    ),
    ExternalMetric(
        "ray_serve_replica_processing_queries",
        "gauge",
        ("application", "deployment", "replica"),
        SERVE_DEPLOYMENT_PANELS,
        "Requests each replica is working on (autoscaling compares it with target_ongoing_requests).",
    ),
    ExternalMetric(
        "ray_serve_deployment_replica_healthy",
        "gauge",
        ("application", "deployment", "replica"),
        SERVE_PANELS,
        "1 per healthy replica.",
    ),
    ExternalMetric(
        "ray_serve_deployment_processing_latency_ms",
        "histogram",
        ("application", "deployment"),
        SERVE_PANELS,
        "Time a replica spent on a request.",
    ),
    # vLLM engines inside Ray Serve LLM
    ExternalMetric(
        "ray_vllm_time_to_first_token_seconds",
        "histogram",
        ("model_name",),
        SERVE_LLM_PANELS,
        "Engine-side time to first token (queueing in the engine included).",
    ),
    ExternalMetric(
        "ray_vllm_num_requests_running",
        "gauge",
        ("model_name",),
        SERVE_LLM_PANELS,
        "Sequences in the engine's running batch.",
    ),
    ExternalMetric(
        "ray_vllm_num_requests_waiting",
        "gauge",
        ("model_name",),
        SERVE_LLM_PANELS,
        "Sequences queued in the engine for KV-cache space: the engine's queue depth.",
    ),
    ExternalMetric(
        "ray_vllm_kv_cache_usage_perc",
        "gauge",
        ("model_name",),
        SERVE_LLM_PANELS,
        "Fraction of KV-cache blocks in use (0-1).",
    ),
    ExternalMetric(
        "ray_vllm_generation_tokens_total", "counter", ("model_name",), SERVE_LLM_PANELS, "Tokens generated."
    ),
    ExternalMetric(
        "ray_vllm_prompt_tokens_total",
        "counter",
        ("model_name",),
        SERVE_LLM_PANELS,
        "Prompt tokens processed (prefill).",
    ),
    # kube-state-metrics
    ExternalMetric(
        "kube_pod_status_unschedulable",
        "gauge",
        ("namespace", "pod"),
        KSM_POD_METRICS,
        "1 while the scheduler cannot place the pod (e.g. no free nvidia.com/gpu).",
    ),
    ExternalMetric(
        "kube_pod_status_phase",
        "gauge",
        ("namespace", "pod", "phase"),
        KSM_POD_METRICS,
        "1 for the pod's current phase (Pending, Running, ...).",
    ),
    ExternalMetric(
        "kube_pod_container_status_waiting_reason",
        "gauge",
        ("namespace", "pod", "container", "reason"),
        KSM_POD_METRICS,
        "1 while a container waits, by reason (CrashLoopBackOff, ImagePullBackOff).",
    ),
    ExternalMetric(
        "kube_pod_container_status_restarts_total",
        "counter",
        ("namespace", "pod", "container"),
        KSM_POD_METRICS,
        "Container restarts.",
    ),
    ExternalMetric(
        "kube_daemonset_status_desired_number_scheduled",
        "gauge",
        ("namespace", "daemonset"),
        KSM_DAEMONSET_METRICS,
        "Nodes that should run the DaemonSet's pod.",
    ),
    ExternalMetric(
        "kube_daemonset_status_number_ready",
        "gauge",
        ("namespace", "daemonset"),
        KSM_DAEMONSET_METRICS,
        "Nodes running a ready pod of the DaemonSet.",
    ),
    # DCGM exporter, one series per GPU (DCGM_EXP_XID_ERRORS_COUNT: per GPU and xid)
    *(
        ExternalMetric(
            f.name,
            "gauge",
            DCGM_LABELS + (("xid",) if f.name.startswith("DCGM_EXP_XID") else ()),
            DCGM_COUNTERS,
            f.help,
        )
        for f in DCGM_FIELDS
    ),
)

_SUFFIXES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def names() -> set[str]:
    """Every series name the listed metrics put in Prometheus."""
    return {m.name + suffix for m in SERVING_METRICS for suffix in _SUFFIXES[m.type]}
