"""NVIDIA's DCGM exporter on every GPU node: utilisation, memory, power and XID errors per GPU,
each labelled with the pod that holds the GPU, so a GPU joins to the Ray worker pod and, through
the vLLM metrics that pod exports, to the models it serves (ops/monitoring).

Plain manifests, rendered here beside the RayService, rather than NVIDIA's Helm chart in
infra/aws/addons.py: the chart's default ServiceMonitor needs the Prometheus Operator's CRDs, which
the stack does not install, while everything of ours is scraped through `prometheus.io/*` pod
annotations (infra/render/gateway.py); the exporter needs the same NetworkPolicy fence as the
gateway's metrics port; and rendered objects are what `llmctl render` prints and the tests
validate. Upstream ships the same shape as a plain manifest (dcgm-exporter.yaml). Facts below are
from NVIDIA/dcgm-exporter at tag 4.5.3-4.8.2 (the pinned image, infra/catalog/versions.py) unless named.

- Placement: the node selector and toleration every GPU node of either provisioner carries
  (infra/render/gpu_node_template.py: label `nvidia.com/gpu.present=true`, taint
  `nvidia.com/gpu=true:NoSchedule`; managed node groups and Karpenter NodePools both set them),
  as the NVIDIA device plugin does.
- GPU access without taking a GPU: the pod asks for no `nvidia.com/gpu` (that would take one from
  Ray). The image sets `NVIDIA_VISIBLE_DEVICES=all` (docker/Dockerfile, runtime-distroless stage)
  and the EKS AL2023 NVIDIA AMI makes `nvidia` containerd's default runtime
  (awslabs/amazon-eks-ami@81fec2e8, nodeadm/internal/containerd/runtime_config_nvidia.go), which
  hands every GPU to a container asking for all.
- Which pod holds each GPU: the kubelet's pod-resources socket, mounted read-only
  (`--pod-resources-kubelet-socket` default /var/lib/kubelet/pod-resources/kubelet.sock,
  pkg/cmd/app.go), with `DCGM_EXPORTER_KUBERNETES=true`; the exporter then adds `pod`,
  `namespace`, `container` (internal/pkg/transformation/const.go). `NODE_NAME` becomes the
  `Hostname` label (internal/pkg/hostname/hostname.go). No Kubernetes API token: it is only
  needed for copying pod labels, which is off (kubernetes.go NewPodMapper carries on without it).
- Scraping: with the Prometheus community chart's `kubernetes-pods` job (`honor_labels: true`,
  prometheus-community/helm-charts charts/prometheus/values.yaml) the exporter's own `pod` and
  `namespace` labels (the GPU's holder) win over the scrape target's; a job without
  honor_labels renames them `exported_pod`/`exported_namespace` and the per-model panels come up
  empty (docs/operations.md says so).
- Security context: root with only CAP_SYS_ADMIN, which the profiling fields (DCGM_FI_PROF_*)
  need, as the chart's values.yaml sets it. No priority class: the chart's
  `system-node-critical` could preempt the Ray worker the exporter watches; its requests fit
  in the share of a GPU node the Ray worker leaves (rayservice.NODE_RESERVED_*).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from infra.catalog.versions import DCGM_EXPORTER_IMAGE
from infra.render.common import COMPONENT_LABEL, labels, metadata
from infra.render.gpu_node_template import GPU_PRESENT_LABEL, GPU_TAINT
from infra.spec.schema import GpuNodeGroup, StackSpec

DCGM_EXPORTER_NAME = "llmstack-dcgm-exporter"
DCGM_COMPONENT = "gpu-metrics"
DCGM_METRICS_PORT = 9400  # DCGM_EXPORTER_LISTEN default ":9400" (deployment/values.yaml service.address)
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"
COUNTERS_DIR = "/etc/llmstack-dcgm"
COUNTERS_FILE = "counters.csv"
GPU_NODE_SELECTOR = {GPU_PRESENT_LABEL: "true"}
GPU_TOLERATION = {"key": GPU_TAINT["key"], "operator": "Exists", "effect": GPU_TAINT["effect"]}


class DcgmField(NamedTuple):
    name: str
    type: str  # Prometheus type as the exporter's CSV names it
    help: str


# The fields the exporter collects. Ours, not the image's default-counters.csv, so the dashboard
# and alerts read only fields this file asks for (a test checks it); each is a line of that
# default file (etc/default-counters.csv), whose comments say what it measures.
FIELDS: tuple[DcgmField, ...] = (
    DcgmField("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    DcgmField("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    DcgmField("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    DcgmField("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    DcgmField("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    # Computed by the exporter (internal/pkg/collector/xid_collector.go): XIDs seen in the last
    # window (--xid-count-window-size, default 5 minutes), one series per `xid` value. Commented
    # out in the default file; the alert needs a count, not the last value.
    DcgmField("DCGM_EXP_XID_ERRORS_COUNT", "gauge", "Count of XID errors within the window (label xid)."),
    # Profiling fields: datacenter GPUs from Volta on (every class in infra/catalog/gpu_catalog.yaml);
    # they need CAP_SYS_ADMIN. GR_ENGINE_ACTIVE is busy time; DRAM_ACTIVE shows the memory-bound
    # decode that GPU_UTIL (any kernel running) reads as 100%.
    DcgmField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    DcgmField("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active."),
    DcgmField(
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "gauge",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
    ),
)


def counters_csv() -> str:
    """The exporter's collectors file: `field, type, help` per line (etc/default-counters.csv format).
    It is read with Go's encoding/csv and refused unless every line has exactly three fields
    (internal/pkg/counters/counter_config.go), so no help text may hold a comma."""
    header = "# Rendered by llmstack (infra/render/dcgm.py). Format: DCGM field, Prometheus type, help.\n"
    return header + "".join(f"{f.name}, {f.type}, {f.help}\n" for f in FIELDS)


def has_gpus(spec: StackSpec) -> bool:
    return any(isinstance(g, GpuNodeGroup) for g in spec.node_groups)


def dcgm_objects(spec: StackSpec) -> list[dict[str, Any]]:
    """The exporter's ConfigMap, DaemonSet and NetworkPolicy; nothing for a stack without GPU nodes."""
    if not has_gpus(spec):
        return []
    return [_counters_config_map(spec), _daemon_set(spec), _network_policy(spec)]


def _selector() -> dict[str, str]:
    return {COMPONENT_LABEL: DCGM_COMPONENT}


def _counters_config_map(spec: StackSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(DCGM_EXPORTER_NAME, DCGM_COMPONENT, spec.name),
        "data": {COUNTERS_FILE: counters_csv()},
    }


def _daemon_set(spec: StackSpec) -> dict[str, Any]:
    health = {"httpGet": {"path": "/health", "port": "metrics"}}  # deployment/templates/daemonset.yaml
    container = {
        "name": "exporter",
        "image": DCGM_EXPORTER_IMAGE,
        "args": ["-f", f"{COUNTERS_DIR}/{COUNTERS_FILE}"],
        "env": [
            {"name": "DCGM_EXPORTER_KUBERNETES", "value": "true"},
            {"name": "DCGM_EXPORTER_LISTEN", "value": f":{DCGM_METRICS_PORT}"},
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "ports": [{"name": "metrics", "containerPort": DCGM_METRICS_PORT}],
        "securityContext": {
            "runAsNonRoot": False,
            "runAsUser": 0,
            "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["SYS_ADMIN"], "drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "pod-resources", "mountPath": POD_RESOURCES_DIR, "readOnly": True},
            {"name": "counters", "mountPath": COUNTERS_DIR, "readOnly": True},
        ],
        # The chart's values.yaml: requests 100m / 128Mi, memory limit 512Mi (no CPU limit here,
        # like our other containers: throttling a scrape only makes it late).
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        # DCGM takes a while to start watching fields (the chart waits 45 s too).
        "livenessProbe": {**health, "initialDelaySeconds": 45, "periodSeconds": 5},
        "readinessProbe": {**health, "initialDelaySeconds": 45},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": metadata(DCGM_EXPORTER_NAME, DCGM_COMPONENT, spec.name),
        "spec": {
            "selector": {"matchLabels": _selector()},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {
                "metadata": {
                    "labels": labels(DCGM_COMPONENT, spec.name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(DCGM_METRICS_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": {
                    "automountServiceAccountToken": False,
                    "nodeSelector": GPU_NODE_SELECTOR,
                    "tolerations": [GPU_TOLERATION],
                    "containers": [container],
                    "volumes": [
                        {"name": "pod-resources", "hostPath": {"path": POD_RESOURCES_DIR, "type": "Directory"}},
                        {"name": "counters", "configMap": {"name": DCGM_EXPORTER_NAME}},
                    ],
                },
            },
        },
    }


def _network_policy(spec: StackSpec) -> dict[str, Any]:
    """Only the stack's Prometheus namespace reaches the exporter: its series name every pod
    holding a GPU, which is nobody else's business (as the gateway's metrics port)."""
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": spec.gateway.metrics_namespace}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(f"{DCGM_EXPORTER_NAME}-ingress", DCGM_COMPONENT, spec.name),
        "spec": {
            "podSelector": {"matchLabels": _selector()},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [prometheus], "ports": [{"protocol": "TCP", "port": DCGM_METRICS_PORT}]}],
        },
    }
