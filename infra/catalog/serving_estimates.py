"""The throughput estimates the serving ingress is sized with (`infra.plan.ingress_plan`), read
from `serving_estimates.yaml` beside this module, where each figure's source is written down."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

from infra.catalog.gpu_catalog import GpuClass

ESTIMATES_PATH = Path(__file__).with_name("serving_estimates.yaml")


class ServingEstimates(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    reference_weight_bytes: float = Field(gt=0, description="Weights of the model the GPU figures are for.")
    replica_output_tokens_per_s: dict[str, float] = Field(
        description="Per GPU class (and `cpu`): output tokens/s of one replica, per GPU."
    )
    router_cpu_ms_per_output_token: float = Field(gt=0, description="Measured LLMRouter CPU per output token.")
    router_target_utilization: float = Field(gt=0, le=1, description="Planned share of a core per router.")


@functools.cache
def load_estimates() -> ServingEstimates:
    estimates = ServingEstimates.model_validate(yaml.safe_load(ESTIMATES_PATH.read_text(encoding="utf-8")))
    missing = {g.value for g in GpuClass} - estimates.replica_output_tokens_per_s.keys()
    if missing or "cpu" not in estimates.replica_output_tokens_per_s:
        raise ValueError(
            f"{ESTIMATES_PATH}: replica_output_tokens_per_s needs every GPU class and cpu; "
            f"missing {sorted(missing | ({'cpu'} - estimates.replica_output_tokens_per_s.keys()))}"
        )
    return estimates
