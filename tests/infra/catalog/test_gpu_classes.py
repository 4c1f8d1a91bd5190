"""The driver-visible memory of each GPU class: sourced, and below what EC2 and the label promise."""

from __future__ import annotations

import pytest

from infra.catalog.gpu_catalog import GpuClass, default_instance_for, gpu_class_info, load_gpu_classes

EC2_MIB = {
    GpuClass.L4: 22_888,
    GpuClass.A10G: 22_888,
    GpuClass.L40S: 45_776,
    GpuClass.A100_40GB: 40_960,
    GpuClass.A100_80GB: 81_920,
    GpuClass.H100_80GB: 81_920,
}


@pytest.mark.parametrize("gpu", list(GpuClass), ids=lambda g: g.value)
def test_every_class_has_a_sourced_driver_total_below_ec2s_figure(gpu: GpuClass):
    info = gpu_class_info(gpu)
    assert info.source.strip()
    assert info.driver_memory_bytes < EC2_MIB[gpu] * 1024**2
    assert info.driver_memory_gib < default_instance_for(gpu).gpu_memory_gib
    # The driver keeps a few percent, never most of the memory: a typo like 2.03 would fail here.
    assert info.driver_memory_bytes > 0.9 * EC2_MIB[gpu] * 1024**2 * 0.95


def test_device_names_tell_a100_apart():
    # vLLM's batch defaults look for "a100" in the torch device name.
    assert "a100" in gpu_class_info(GpuClass.A100_80GB).device_name.lower()
    assert "a100" not in gpu_class_info(GpuClass.H100_80GB).device_name.lower()


def test_classes_are_keyed_by_gpu_class():
    assert set(load_gpu_classes()) == set(GpuClass)
