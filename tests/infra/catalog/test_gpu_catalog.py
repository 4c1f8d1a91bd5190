"""The GPU catalog loads, is internally sane, and answers the lookups the stack relies on."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infra.catalog import gpu_catalog
from infra.catalog.gpu_catalog import (
    GpuClass,
    InstanceType,
    default_instance_for,
    instance_type,
    load_catalog,
    load_gpu_classes,
)


def test_every_entry_loads_as_an_instance_type() -> None:
    catalog = load_catalog()
    assert len(catalog) >= 27
    for name, item in catalog.items():
        assert isinstance(item, InstanceType)
        assert item.instance_type == name


@pytest.mark.parametrize("item", list(load_catalog().values()), ids=lambda i: i.instance_type)
def test_figures_are_positive_and_sourced(item: InstanceType) -> None:
    assert item.gpus > 0
    assert item.gpu_memory_gib > 0
    assert item.vcpus > 0
    assert item.memory_gib > 0
    assert item.on_demand_usd_per_hour > 0
    assert item.source.strip()


@pytest.mark.parametrize("family", ["g6", "g5", "g6e", "p4d", "p4de", "p5"])
def test_each_family_is_present(family: str) -> None:
    assert any(name.split(".")[0] == family for name in load_catalog())


def test_unknown_instance_type_error_lists_known_names() -> None:
    with pytest.raises(KeyError) as excinfo:
        instance_type("nope")
    message = str(excinfo.value)
    assert "'nope'" in message
    for name in ("g6.xlarge", "g5.48xlarge", "p5.48xlarge"):
        assert name in message


@pytest.mark.parametrize(
    ("gpu_class", "expected"),
    [
        (GpuClass.L4, "g6.xlarge"),
        (GpuClass.A10G, "g5.xlarge"),
        (GpuClass.L40S, "g6e.xlarge"),
        (GpuClass.A100_40GB, "p4d.24xlarge"),
        (GpuClass.A100_80GB, "p4de.24xlarge"),
        (GpuClass.H100_80GB, "p5.48xlarge"),
    ],
)
def test_default_instance_for_each_class(gpu_class: GpuClass, expected: str) -> None:
    assert default_instance_for(gpu_class).instance_type == expected


def test_g6_12xlarge_has_four_l4() -> None:
    item = instance_type("g6.12xlarge")
    assert (item.gpu_class, item.gpus, item.gpu_memory_gib) == (GpuClass.L4, 4, 24)


def test_p4de_has_eight_80gb_a100() -> None:
    item = instance_type("p4de.24xlarge")
    assert (item.gpu_class, item.gpus, item.gpu_memory_gib) == (GpuClass.A100_80GB, 8, 80)


def test_entries_are_frozen() -> None:
    with pytest.raises(ValidationError):
        instance_type("g5.xlarge").gpus = 2  # type: ignore[misc]


def test_bad_entry_error_names_file_and_entry(tmp_path, monkeypatch) -> None:
    bad = tmp_path / "gpu_catalog.yaml"
    bad.write_text("gpu_classes: []\ninstance_types:\n- instance_type: g9.xlarge\n  gpu_class: L4\n  gpus: 0\n")
    monkeypatch.setattr(gpu_catalog, "CATALOG_PATH", bad)
    load_catalog.cache_clear()
    load_gpu_classes.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"gpu_catalog\.yaml: instance_types entry \[0\] \(g9\.xlarge\)"):
            load_catalog()
        with pytest.raises(ValueError, match=r"gpu_classes has no entry for A100-40GB, A100-80GB, A10G"):
            load_gpu_classes()
    finally:
        load_catalog.cache_clear()
        load_gpu_classes.cache_clear()
