"""The throughput estimates file: every figure carries its source, totals cover outputs, and
matching is by GPU class, tensor parallelism, size and 16-bit weights only."""

from __future__ import annotations

import pytest
import yaml

from infra.catalog import throughput
from infra.catalog.gpu_catalog import GpuClass
from infra.catalog.throughput import ESTIMATES_PATH, estimate_for, load_estimates


def test_every_estimate_is_sourced_and_consistent():
    estimates = load_estimates()
    assert len(estimates) >= 3
    for item in estimates:
        assert item.source.strip() and item.workload.strip()
        assert item.total_tokens_per_s >= item.output_tokens_per_s
        assert item.min_parameters_b <= item.max_parameters_b
    shapes = [(e.gpu_class, e.tensor_parallel_size, e.min_parameters_b) for e in estimates]
    assert len(shapes) == len(set(shapes)), "two estimates for one shape: which one would match is arbitrary"


def test_matching():
    l4 = estimate_for(GpuClass.L4, tensor_parallel_size=1, parameters=8_030_261_248, quantized=False)
    assert l4 is not None and l4.estimate and "llm-price-compass" in l4.source
    assert estimate_for(GpuClass.L4, tensor_parallel_size=2, parameters=8_030_261_248, quantized=False) is None
    assert estimate_for(GpuClass.L4, tensor_parallel_size=1, parameters=70_000_000_000, quantized=False) is None
    assert estimate_for(GpuClass.L4, tensor_parallel_size=1, parameters=8_030_261_248, quantized=True) is None
    assert estimate_for(GpuClass.H100_80GB, tensor_parallel_size=1, parameters=8_030_261_248, quantized=False) is None


def test_a_bad_entry_names_the_file_and_entry(tmp_path, monkeypatch):
    bad = tmp_path / "estimates.yaml"
    bad.write_text(yaml.safe_dump([{"gpu_class": "L4", "tensor_parallel_size": 1}]))
    monkeypatch.setattr(throughput, "ESTIMATES_PATH", bad)
    load_estimates.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"estimates.yaml: entry \[0\]"):
            load_estimates()
    finally:
        load_estimates.cache_clear()
    assert ESTIMATES_PATH.name == "throughput_estimates.yaml"
