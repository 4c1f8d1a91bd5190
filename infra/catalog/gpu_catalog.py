"""The EC2 GPU instance types we can place model replicas on, and the memory the CUDA driver
shows on each GPU class, read from `gpu_catalog.yaml`.

The figures (GPUs, memory, prices) live in YAML beside this module, not in code, because they
are data with a source and a date: prices change, AWS adds sizes, and a reviewer should be able
to check each entry against its citation without reading Python. This module only types and
validates that data once, at load time, so everything downstream can trust it.
"""

from __future__ import annotations

import functools
from enum import Enum
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

CATALOG_PATH = Path(__file__).with_name("gpu_catalog.yaml")


class GpuClass(str, Enum):
    """The GPU a node carries, as a model-placement decision cares about it.

    A100 is split by memory because 40 GB and 80 GB parts decide different things (what fits),
    while the EC2 family name alone (p4d vs p4de) is easy to mix up.
    """

    L4 = "L4"
    A10G = "A10G"
    L40S = "L40S"
    A100_40GB = "A100-40GB"
    A100_80GB = "A100-80GB"
    H100_80GB = "H100-80GB"


class InstanceType(BaseModel):
    """One EC2 instance type: what it carries and what it costs (us-east-1, Linux, On-Demand)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instance_type: str = Field(description="EC2 instance type name, e.g. `g6.xlarge`.")
    gpu_class: GpuClass = Field(description="GPU model on the instance; every GPU is the same.")
    gpus: int = Field(gt=0, description="Number of GPUs per instance.")
    gpu_memory_gib: int = Field(
        gt=0,
        description=(
            "Nominal memory per GPU (24 for L4/A10G, 48 for L40S). EC2 reports a little less "
            "usable memory for the GDDR6 parts, so leave headroom when checking a model fits."
        ),
    )
    vcpus: int = Field(gt=0, description="vCPUs per instance.")
    memory_gib: int = Field(gt=0, description="Host RAM per instance, GiB.")
    on_demand_usd_per_hour: float = Field(
        gt=0, description="Linux On-Demand price in us-east-1, USD/hour. A snapshot: re-check."
    )
    source: str = Field(min_length=1, description="Where the figures came from and when.")
    note: str | None = Field(default=None, description="Caveats, e.g. a figure that no AWS page confirmed.")


class GpuClassInfo(BaseModel):
    """What the CUDA driver shows a process on one GPU of a class: vLLM sizes its memory from this."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_class: GpuClass = Field(description="The GPU class these figures describe.")
    device_name: str = Field(min_length=1, description="The device name torch reports, e.g. `NVIDIA L4`.")
    driver_memory_gib: float = Field(
        gt=0, description="Total memory the driver reports to a process (cudaMemGetInfo), GiB."
    )
    source: str = Field(min_length=1, description="The logs the figure was read from, and when.")
    note: str | None = Field(default=None, description="Caveats, e.g. a figure seen in one log only.")

    @property
    def driver_memory_bytes(self) -> int:
        return round(self.driver_memory_gib * 1024**3)


def _read_catalog() -> dict:
    document = yaml.safe_load(CATALOG_PATH.read_text(encoding="utf-8"))
    if not isinstance(document, dict) or not {"gpu_classes", "instance_types"} <= document.keys():
        raise ValueError(f"{CATALOG_PATH}: expected the keys `gpu_classes` and `instance_types` at the top level")
    return document


def _validated(entries: object, model: type[BaseModel], key: str, name_field: str) -> list:
    if not isinstance(entries, list):
        raise ValueError(f"{CATALOG_PATH}: `{key}` must be a list")  # noqa: TRY004 (a bad file, not a bad call)
    items = []
    for index, entry in enumerate(entries):
        name = entry.get(name_field, "?") if isinstance(entry, dict) else "?"
        try:
            items.append(model.model_validate(entry))
        except ValidationError as exc:
            raise ValueError(f"{CATALOG_PATH}: {key} entry [{index}] ({name}) is invalid:\n{exc}") from exc
    return items


@functools.cache
def load_catalog() -> dict[str, InstanceType]:
    """Every catalogued instance type, keyed by name, validated once and cached.

    The cache is shared: treat the returned dict as read-only. Errors name the YAML file and the
    entry so a bad edit is found without a debugger.
    """
    catalog: dict[str, InstanceType] = {}
    for index, item in enumerate(
        _validated(_read_catalog()["instance_types"], InstanceType, "instance_types", "instance_type")
    ):
        if item.instance_type in catalog:
            raise ValueError(
                f"{CATALOG_PATH}: instance_types entry [{index}] repeats {item.instance_type!r}; keep one entry"
            )
        catalog[item.instance_type] = item
    return catalog


@functools.cache
def load_gpu_classes() -> dict[GpuClass, GpuClassInfo]:
    """Driver-visible memory and device name of every GPU class, validated once and cached."""
    classes = {
        item.gpu_class: item
        for item in _validated(_read_catalog()["gpu_classes"], GpuClassInfo, "gpu_classes", "gpu_class")
    }
    missing = sorted(c.value for c in GpuClass if c not in classes)
    if missing:
        raise ValueError(f"{CATALOG_PATH}: gpu_classes has no entry for {', '.join(missing)}")
    return classes


def instance_type(name: str) -> InstanceType:
    """Look up one instance type; the error lists what is known so a typo is easy to fix."""
    catalog = load_catalog()
    try:
        return catalog[name]
    except KeyError:
        known = ", ".join(sorted(catalog))
        raise KeyError(f"unknown instance type {name!r}; {CATALOG_PATH.name} knows: {known}") from None


def default_instance_for(gpu_class: GpuClass) -> InstanceType:
    """The cheapest instance carrying `gpu_class`: the default when a stack names only a GPU.

    Cheapest, because larger sizes buy more GPUs, vCPUs or RAM, and a stack that needs those
    should say so by naming the instance type. Ties go to fewer GPUs, then to the name, so the
    answer never depends on YAML order.
    """
    gpu_class = GpuClass(gpu_class)
    candidates = [item for item in load_catalog().values() if item.gpu_class is gpu_class]
    if not candidates:
        raise KeyError(f"{CATALOG_PATH.name} has no instance type with GPU class {gpu_class.value}")
    return min(candidates, key=lambda i: (i.on_demand_usd_per_hour, i.gpus, i.instance_type))


def gpu_class_info(gpu_class: GpuClass) -> GpuClassInfo:
    """The driver-visible memory and device name of one GPU class."""
    return load_gpu_classes()[GpuClass(gpu_class)]
