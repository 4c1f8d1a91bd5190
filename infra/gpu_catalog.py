"""The EC2 GPU instance types we can place model replicas on, read from `gpu_catalog.yaml`.

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
    note: str | None = Field(
        default=None, description="Caveats, e.g. a figure that no AWS page confirmed."
    )


@functools.cache
def load_catalog() -> dict[str, InstanceType]:
    """Every catalogued instance type, keyed by name, validated once and cached.

    The cache is shared: treat the returned dict as read-only. Errors name the YAML file and the
    entry so a bad edit is found without a debugger.
    """
    entries = yaml.safe_load(CATALOG_PATH.read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{CATALOG_PATH}: expected a list of instance types at the top level")
    catalog: dict[str, InstanceType] = {}
    for index, entry in enumerate(entries):
        name = entry.get("instance_type", "?") if isinstance(entry, dict) else "?"
        try:
            item = InstanceType.model_validate(entry)
        except ValidationError as exc:
            message = f"{CATALOG_PATH}: entry [{index}] ({name}) is invalid:\n{exc}"
            raise ValueError(message) from exc
        if item.instance_type in catalog:
            raise ValueError(
                f"{CATALOG_PATH}: entry [{index}] repeats {item.instance_type!r}; keep one entry"
            )
        catalog[item.instance_type] = item
    return catalog


def instance_type(name: str) -> InstanceType:
    """Look up one instance type; the error lists what is known so a typo is easy to fix."""
    catalog = load_catalog()
    try:
        return catalog[name]
    except KeyError:
        known = ", ".join(sorted(catalog))
        raise KeyError(
            f"unknown instance type {name!r}; {CATALOG_PATH.name} knows: {known}"
        ) from None


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


# Memory per GPU as EC2 reports it (DescribeInstanceTypes GpuInfo.MemoryInfo.SizeInMiB, as
# listed in Karpenter's generated instance-type reference). The GDDR6 parts report less than
# their nominal 24/48 GB; vLLM's gpu_memory_utilization is a fraction of this total.
_EC2_GPU_MEMORY_MIB = {
    GpuClass.L4: 22_888,
    GpuClass.A10G: 22_888,
    GpuClass.L40S: 45_776,
    GpuClass.A100_40GB: 40_960,
    GpuClass.A100_80GB: 81_920,
    GpuClass.H100_80GB: 81_920,
}


def usable_gpu_memory_bytes(gpu_class: GpuClass) -> int:
    """Total memory of one GPU of this class in bytes, as the instance reports it."""
    return _EC2_GPU_MEMORY_MIB[GpuClass(gpu_class)] * 1024 * 1024
