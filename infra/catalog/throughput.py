"""How many tokens per second one model replica serves: the denominator of every $/token.

Two sources, in order of trust: a measurement of your own stack (`llmctl bench`, turned into a
`Throughput` by `ops.llmctl.cost`), or a published figure from `throughput_estimates.yaml`
matched by GPU class, tensor parallelism and model size. Like the GPU catalog, the estimates are
data with a source each, validated once here.
"""

from __future__ import annotations

import functools
from decimal import Decimal
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from infra.catalog.gpu_catalog import GpuClass

ESTIMATES_PATH = Path(__file__).with_name("throughput_estimates.yaml")


class Throughput(BaseModel):
    """Tokens per second of one replica, and where the figure came from."""

    model_config = ConfigDict(frozen=True)

    output_tokens_per_s: Decimal = Field(gt=0, description="Generated tokens per second.")
    total_tokens_per_s: Decimal = Field(gt=0, description="Prompt + generated tokens per second.")
    estimate: bool = Field(description="A published figure for similar hardware, not a measurement of this stack.")
    source: str = Field(description="The bench file and level, or the estimate's citation.")

    @model_validator(mode="after")
    def _total_covers_output(self) -> Throughput:
        if self.total_tokens_per_s < self.output_tokens_per_s:
            raise ValueError("total_tokens_per_s counts prompt and output tokens: it cannot be below output")
        return self


class ThroughputEstimate(BaseModel):
    """One published measurement (see throughput_estimates.yaml for the matching rule)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_class: GpuClass = Field(description="GPU the figure was measured on.")
    tensor_parallel_size: int = Field(ge=1, description="GPUs per replica in the measurement.")
    min_parameters_b: float = Field(gt=0, description="Smallest model (billions of parameters) it stands for.")
    max_parameters_b: float = Field(gt=0, description="Largest model it stands for.")
    output_tokens_per_s: Decimal = Field(gt=0, description="Generated tokens per second, one replica.")
    total_tokens_per_s: Decimal = Field(gt=0, description="Prompt + generated tokens per second.")
    workload: str = Field(min_length=1, description="Model, engine, dataset and load of the measurement.")
    source: str = Field(min_length=1, description="Where the figure was published.")
    note: str | None = Field(default=None, description="Caveats: derived figures, other measurements.")

    def as_throughput(self) -> Throughput:
        return Throughput(
            output_tokens_per_s=self.output_tokens_per_s,
            total_tokens_per_s=self.total_tokens_per_s,
            estimate=True,
            source=f"estimate for {self.gpu_class.value}: {self.source}",
        )


@functools.cache
def load_estimates() -> tuple[ThroughputEstimate, ...]:
    """Every estimate, validated once; errors name the file and the entry."""
    entries = yaml.safe_load(ESTIMATES_PATH.read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise ValueError(f"{ESTIMATES_PATH}: expected a list of estimates at the top level")
    estimates = []
    for index, entry in enumerate(entries):
        try:
            estimates.append(ThroughputEstimate.model_validate(entry))
        except ValidationError as exc:
            raise ValueError(f"{ESTIMATES_PATH}: entry [{index}] is invalid:\n{exc}") from exc
    return tuple(estimates)


def estimate_for(
    gpu_class: GpuClass, *, tensor_parallel_size: int, parameters: int, quantized: bool
) -> Throughput | None:
    """The published figure standing for this replica shape, or None (then only a bench helps).

    Quantized models are never matched: the estimates are all 16-bit measurements, and
    quantization changes throughput in either direction depending on the kernel."""
    if quantized:
        return None
    billions = parameters / 1e9
    for item in load_estimates():
        if (
            item.gpu_class is GpuClass(gpu_class)
            and item.tensor_parallel_size == tensor_parallel_size
            and item.min_parameters_b <= billions <= item.max_parameters_b
        ):
            return item.as_throughput()
    return None
